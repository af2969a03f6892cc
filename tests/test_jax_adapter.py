"""The JAX adapter in one process: what it refuses (another model, other PRNG settings) in one line with
nothing changed, how it counts steps for any loop, a functional state restored on its template, and the
loop's PRNG key kept among the loop's variables. The kill-and-resume tests are in test_jax_crash.py."""
from __future__ import annotations

import functools
import random
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from keepalive.callbacks.jax import DriveCheckpoint
from keepalive.errors import StateMismatchError, UnsupportedStateError
from keepalive.loopstate import JAX_MARK, _put_back, _snapshot, plain_size


def _nnx(width: int = 3):
    model = nnx.Sequential(nnx.Linear(4, width, rngs=nnx.Rngs(0)), nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))
    return model, nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)


@nnx.jit
def _step(model, optimizer, x):
    optimizer.update(model, nnx.grad(lambda m: (m(x) ** 2).mean())(model))


def _train(ckpt, model, optimizer, epochs: int, batches):
    for _ in ckpt.epochs(epochs):
        for x in ckpt.batches(batches):
            _step(model, optimizer, x)


def _leaves(obj):
    return [np.array(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)
            for v in jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(obj)))]


BATCHES = [jnp.full((2, 4), float(i)) for i in range(3)]


def _generated():
    yield from BATCHES


def test_nnx_objects_resume_in_place_and_a_generator_saves_at_epoch_ends(tmp_path, capsys):
    """Steps counted per batch of ckpt.batches() (no ckpt.update() call): every=2 asks for saves inside
    epochs, which a generator cannot resume: one line says so at the first save, saves land at epoch ends.
    A new process's objects (built anew) get the saved state in place, dropout's key and count too."""
    model, opt = _nnx()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2)
    for _ in ckpt.epochs(2):
        for x in ckpt.batches(_generated()):
            _step(model, opt, x)
    ckpt.close()
    err = capsys.readouterr().err
    assert ckpt.step == 6 and err.count("a generator has no state keepalive can save") == 1, err
    assert sorted(i.step for i in ckpt.core.store.list()) == [3, 6]  # the epoch ends: none inside
    model2, opt2 = _nnx()
    _step(model2, opt2, BATCHES[0])  # not the saved state
    ckpt2 = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    assert ckpt2.resume() and ckpt2.step == 6 and ckpt2.epoch == 2
    for a, b in zip(_leaves(model) + _leaves(opt), _leaves(model2) + _leaves(opt2)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    ckpt2.close()


def test_a_list_of_batches_resumes_inside_its_epoch_with_the_host_rngs(tmp_path):
    """A list continues at the saved index; Python's and NumPy's global generators (drawn in the loop:
    an augmentation) continue from the saved step's state, the epoch's prologue from the epoch's."""
    def draws():
        return (random.random(), float(np.random.rand()))

    random.seed(5)
    np.random.seed(5)
    expected = [draws() for _ in range(4)]  # the prologue's, then one per batch
    random.seed(5)
    np.random.seed(5)
    model, opt = _nnx()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    seen = []
    with pytest.raises(KeyError):  # the process dies in the third batch
        for _ in ckpt.epochs(1):
            seen.append(draws())
            for i, x in enumerate(ckpt.batches(BATCHES)):
                if i == 2:
                    raise KeyError("killed")
                seen.append(draws())
                _step(model, opt, x)
    ckpt.close()
    draws()  # the generators move on before the resume
    ckpt2 = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    batches = []
    for _ in ckpt2.epochs(1):
        prologue = draws()
        for x in ckpt2.batches(BATCHES):
            batches.append(float(x[0, 0]))
            resumed = draws()
    assert batches == [2.0] and ckpt2.step == 3
    assert seen == expected[:3] and prologue == expected[0] and resumed == expected[3]
    ckpt2.close()


def test_a_step_loop_over_a_grain_dataset_without_epochs_saves_and_resumes_inside_it(tmp_path):
    """Flax's tutorial loop: ``for step, batch in enumerate(ckpt.batches(ds))`` with no ckpt.epochs():
    every=2 saves inside the pass (steps counted per batch), a resume continues at the saved element of
    the Grain dataset's order (its iterator's get_state / set_state): nothing read twice or skipped."""
    import grain

    ds = grain.MapDataset.source(np.arange(12, dtype=np.float32)).shuffle(seed=1).batch(2)
    order = [b.tolist() for b in ds]
    model, opt = _nnx()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    seen = []
    with pytest.raises(KeyError):  # the process dies in the fourth batch, after the save of step 2
        for step, batch in enumerate(ckpt.batches(ds)):
            if step == 3:
                raise KeyError("killed")
            seen.append(batch.tolist())
            _step(model, opt, jnp.ones((2, 4)) * batch[:, None])
    ckpt.close()
    assert [i.step for i in ckpt.core.store.list()] == [2]
    ckpt2 = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    resumed = [batch.tolist() for batch in ckpt2.batches(ds)]
    assert ckpt2.step == 6 and seen[:2] + resumed == order, (seen, resumed, order)
    ckpt2.close()


def test_an_iterator_kept_across_epochs_continues_where_it_was(tmp_path, capsys):
    """One Grain iterator for the whole run, ``ckpt.batches(it, steps=3)`` per epoch: a resume
    continues the iterator at the saved element and the resumed epoch ends after its 3 batches. The same
    with ``zip(range(3), ckpt.batches(it))``, whose count restarts at 0 after a resume: told, with the fix."""
    import grain

    def make():
        return iter(grain.MapDataset.source(np.arange(40, dtype=np.float32)).shuffle(seed=2).batch(2)
                    .to_iter_dataset())

    order = [b.tolist() for _, b in zip(range(9), make())]
    model, opt = _nnx()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, every=2, quiet=True)
    seen = []
    with pytest.raises(KeyError):
        it = make()
        for epoch in ckpt.epochs(3):
            for i, batch in zip(range(3), ckpt.batches(it)):
                if (epoch, i) == (1, 2):
                    raise KeyError("killed")  # after the save of step 4 (epoch 1, its first batch)
                seen.append(batch.tolist())
    ckpt.close()
    shutil.copytree(tmp_path / "run", tmp_path / "zipped")
    ckpt2 = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    it = make()
    for epoch in ckpt2.epochs(3):
        for batch in ckpt2.batches(it, steps=3):
            seen.append(batch.tolist())
    assert ckpt.step == 5 and ckpt2.step == 9
    assert seen[:4] + seen[5:] == order, (seen, order)
    ckpt2.close()
    assert "ckpt.batches(it, steps=k)" not in capsys.readouterr().err
    zipped = DriveCheckpoint(tmp_path / "zipped", model=model, optimizer=opt, quiet=True)
    it = make()
    for epoch in zipped.epochs(3):
        for _, batch in zip(range(3), zipped.batches(it)):
            pass
    zipped.close()
    assert zipped.step == 10 and "Write ckpt.batches(it, steps=k)" in capsys.readouterr().err


def test_bfloat16_parameters_resume_bit_for_bit(tmp_path):
    """What TPU users train in: bf16 parameters and optimizer moments, stored as bf16 and put back
    with their dtype."""
    def build():
        model = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(0.01, mu_dtype=jnp.bfloat16), wrt=nnx.Param)

    model, opt = build()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    _train(ckpt, model, opt, 1, BATCHES)
    ckpt.close()
    model2, opt2 = build()
    ckpt2 = DriveCheckpoint(tmp_path / "run", model=model2, optimizer=opt2, quiet=True)
    assert ckpt2.resume()
    assert model2.kernel[...].dtype == jnp.bfloat16
    for a, b in zip(_leaves(model) + _leaves(opt), _leaves(model2) + _leaves(opt2)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    ckpt2.close()


def test_a_model_of_other_shapes_is_refused_in_one_line_and_nothing_changes(tmp_path):
    model, opt = _nnx()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    _train(ckpt, model, opt, 1, BATCHES)
    ckpt.close()
    wider, wider_opt = _nnx(width=5)
    before = _leaves(wider) + _leaves(wider_opt)
    ckpt2 = DriveCheckpoint(tmp_path / "run", model=wider, optimizer=wider_opt, quiet=True)
    with pytest.raises(StateMismatchError) as err:
        ckpt2.resume()
    message = str(err.value)
    assert "\n" not in message and "shape (3,) in the checkpoint" in message and "(5,) here" in message, message
    assert "Nothing was loaded" in message
    assert all(np.array_equal(a, b) for a, b in zip(before, _leaves(wider) + _leaves(wider_opt)))
    assert ckpt2.step == 0
    ckpt2.close()


def test_another_prng_implementation_is_refused_in_one_line(tmp_path):
    model, opt = _nnx()
    ckpt = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
    _train(ckpt, model, opt, 1, BATCHES)
    ckpt.close()
    partitionable = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", not partitionable)
    try:
        ckpt2 = DriveCheckpoint(tmp_path / "run", model=model, optimizer=opt, quiet=True)
        with pytest.raises(StateMismatchError) as err:
            ckpt2.resume()
    finally:
        jax.config.update("jax_threefry_partitionable", partitionable)
    message = str(err.value)
    assert "\n" not in message and f"jax_threefry_partitionable={partitionable!r}" in message, message
    assert f"jax.config.update('jax_threefry_partitionable', {partitionable!r})" in message
    ckpt2.close()


def test_a_functional_state_is_handed_over_and_given_back_on_its_template(tmp_path, capsys):
    """ckpt.update(state) counts the steps (two per batch here) and keeps the newest state; a resume's
    ckpt.state has the saved values with the template's structure and dtypes (a step count built as a
    Python 0 comes back as the saved array), also when each step donates the state it is given. A loop
    that never takes the restored state is told."""
    from flax.training import train_state

    def make():
        params = {"w": jnp.ones((4,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))

    @functools.partial(jax.jit, donate_argnums=0)  # the old state's buffers are given to the new one
    def step(state, x):
        return state.apply_gradients(grads=jax.grad(lambda p: ((x @ p["w"]).sum() * 0.01 + p["b"]) ** 2)(state.params))

    state = make()
    ckpt = DriveCheckpoint(tmp_path / "run", state=state, quiet=True, every=4)
    state = ckpt.state
    for _ in ckpt.epochs(2):
        for x in ckpt.batches(BATCHES):
            state = ckpt.update(step(state, x))
            ckpt.update(state=step(state, x))
            state = ckpt.state
    ckpt.close()
    assert ckpt.step == 12 and int(state.step) == 12
    ckpt2 = DriveCheckpoint(tmp_path / "run", state=make(), quiet=True)
    restored = ckpt2.state
    assert isinstance(restored, train_state.TrainState) and restored.tx is not None
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(np.asarray(a), np.asarray(b))
    ckpt2.close()
    stale = DriveCheckpoint(tmp_path / "stale", state=state, quiet=True)
    step(stale.state, BATCHES[0])  # its buffers donated, and the new state never handed over
    with pytest.raises(UnsupportedStateError, match=r"donated to a jitted step .* ckpt.update\(state=...\)"):
        stale.save(sync=True)
    stale.close()
    forgot = DriveCheckpoint(tmp_path / "run", state=make(), quiet=True)
    for _ in forgot.epochs(3):  # the restored state never taken: said once, with the line that fixes it
        for x in forgot.batches(BATCHES):
            forgot.update(step(make(), x))
    forgot.close()
    err = capsys.readouterr().err
    # `state` is handed over with ckpt.update(): not named among a function's variables nobody keeps
    assert not re.search(r"cannot be put back on resume: [^.]*\bstate\b", err), err
    assert err.count("the loop never took the restored state (ckpt.state)") == 1, err
    assert "Write `state = ckpt.state`" in err


def test_the_loops_prng_key_is_kept_as_key_data_and_put_back_typed():
    key = jax.random.split(jax.random.key(3))[0]
    saved = _snapshot([key, jnp.float32(2.5)], [])
    assert saved[0][JAX_MARK].dtype == np.uint32 and saved[0]["key"] == "threefry2x32"
    back = _put_back(saved, [])
    assert jnp.issubdtype(back[0].dtype, jax.dtypes.prng_key)
    assert np.array_equal(jax.random.key_data(back[0]), jax.random.key_data(key))
    assert np.array_equal(jax.random.uniform(back[0], (3,)), jax.random.uniform(key, (3,)))
    assert float(back[1]) == 2.5
    donated = jnp.ones(3)
    functools.partial(jax.jit, donate_argnums=0)(lambda a: a * 2)(donated)
    assert plain_size([key, donated]) is None  # a buffer given to a step: not kept (named if carried)


def test_what_holds_no_state_is_refused_with_what_to_pass(tmp_path):
    import flax.linen as nn

    with pytest.raises(TypeError, match="a Linen module holds no weights: pass its TrainState"):
        DriveCheckpoint(tmp_path / "run", model=nn.Dense(3))
    with pytest.raises(TypeError, match="did you mean every="):
        DriveCheckpoint(tmp_path / "run", evry=3)


def test_a_history_appended_by_key_is_one_of_the_loops_variables():
    """Flax's ``metrics_history[f'train_{metric}'].append(value)``: the dict is kept with the loop's
    variables (at the top level); ``self.history[k].append(v)`` names no variable."""
    from keepalive.loopstate import read_loop

    top = compile("for e in r:\n    for metric, value in m.items():\n"
                  "        metrics_history[f'train_{metric}'].append(value)\n", "<cell>", "exec")
    assert "metrics_history" in read_loop(top, 0, True).globals

    def method(self, r):
        for _ in r:
            self.history["loss"].append(1)

    loop = read_loop(method.__code__, 0, False)
    assert "self" not in loop.locals and "self" not in loop.carried


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "control-never-settled"])
def test_a_save_holds_the_arrays_and_is_settled_before_the_next_donating_step(tmp_path, monkeypatch, capsys,
                                                                              settled):
    """A save copies nothing in the loop: it holds the state's jax arrays themselves (the store copies them
    after save() returned), and keepalive settles that copy before it hands out the next batch, so no step
    (which donates the state) runs while a save's copy is pending; every save is committed, the last one
    holds the final state. The control, with the settle made a no-op, shows steps running unsettled."""
    step = jax.jit(lambda s, x: {"w": s["w"] * 0.5 + x.sum(), "n": s["n"] + 1}, donate_argnums=0)
    ckpt = DriveCheckpoint(tmp_path / "run", state={"w": jnp.arange(8.0), "n": jnp.zeros((), jnp.int32)},
                           every=1, quiet=True)
    if not settled:
        monkeypatch.setattr(ckpt.core, "settle_snapshot", lambda: None)
    unsettled_at_step = []
    state = ckpt.state
    for _ in ckpt.epochs(2):
        for x in ckpt.batches(BATCHES):
            unsettled_at_step.append(ckpt.core.writer.unsettled)
            state = ckpt.update(step(state, x))
    stored = ckpt.capture()["objects"]["state"]
    ckpt.close()
    if not settled:
        assert any(unsettled_at_step)
        return
    assert not any(unsettled_at_step) and len(unsettled_at_step) == 6
    assert stored["w"] is state["w"] and stored["n"] is state["n"]  # by reference, not a host copy
    assert "was deleted before the checkpoint copied it" not in capsys.readouterr().err
    assert [i.step for i in ckpt.core.store.list()][-1] == 6
    back = DriveCheckpoint(tmp_path / "run", state={"w": jnp.zeros(8), "n": jnp.zeros((), jnp.int32)}, quiet=True)
    assert np.array_equal(back.state["w"], state["w"]) and int(back.state["n"]) == 6
    back.close()


@pytest.mark.parametrize("registered", [True, False], ids=["data_rng", "control-unregistered"])
def test_a_generator_drawing_from_a_registered_rng_resumes_inside_its_epoch(tmp_path, registered):
    """``ckpt.batches(batches(rng))``, a generator function made anew each epoch that draws its order (and
    a noise) from a ``np.random.Generator``, which the loop draws from too: registered as ``data_rng``, a
    resume puts it back at the epoch's start (the prologue's draw replays), runs the rebuilt generator
    past the batches done and continues from the saved step's state: the same batches and draws as an
    uninterrupted run. The control, the generator not registered, resumes at the epoch end with a fresh
    rng: the order differs."""
    x = np.arange(16, dtype=np.float32).reshape(8, 2)

    def batches(rng):
        perm = rng.permutation(8)
        for i in range(0, 8, 2):
            yield x[perm[i:i + 2]] + np.float32(rng.normal())

    def train(ckpt, rng, kill_at=None):
        seen, state = [], ckpt.state
        for epoch in ckpt.epochs(3):
            seen.append(("prologue", int(rng.integers(100))))
            for i, b in enumerate(ckpt.batches(batches(rng))):
                if (epoch, i) == kill_at:
                    raise KeyError("killed")
                seen.append((b.tolist(), float(rng.random())))
                state = ckpt.update({"w": state["w"] + jnp.asarray(b.sum(0))})
        return seen, state

    expected, rng = [], np.random.default_rng(0)
    for _ in range(3):  # the same loop without keepalive
        expected.append(("prologue", int(rng.integers(100))))
        expected += [(b.tolist(), float(rng.random())) for b in batches(rng)]
    extra = {"data_rng": np.random.default_rng(0)} if registered else {}
    make = functools.partial(DriveCheckpoint, tmp_path / "run", state={"w": jnp.zeros(2)}, every=3, quiet=True)
    ckpt = make(**extra)
    with pytest.raises(KeyError):  # dies in epoch 1's fourth batch: the last save is step 6, mid-epoch
        train(ckpt, extra.get("data_rng", np.random.default_rng(0)), kill_at=(1, 3))
    ckpt.close()
    rng2 = np.random.default_rng(0)
    rng2.random(7)  # a new process's generator, drawn elsewhere before the resume
    ckpt2 = make(**({"data_rng": rng2} if registered else {}))
    seen, _ = train(ckpt2, rng2)
    ckpt2.close()
    if not registered:
        assert seen != expected[-len(seen):]
        return
    assert ckpt2.step == 12 and seen == [expected[5]] + expected[8:], (seen, expected)


def test_a_tf_data_pipeline_made_each_epoch_resumes_exactly_at_epoch_ends_and_is_told(tmp_path, capsys):
    """A ``tf.data.Dataset`` has no state keepalive saves: every=2 asks for saves inside epochs, one line
    says they land at epoch ends (and how a tf.data order stays exact), and a run killed inside epoch 1
    resumes at its start with the same batches as an uninterrupted run (the pipeline made in each epoch
    with a seeded shuffle)."""
    import tensorflow as tf
    x = np.arange(16, dtype=np.float32).reshape(8, 2)

    def make(epoch):
        return tf.data.Dataset.from_tensor_slices(x).shuffle(8, seed=100 + epoch).batch(2)

    def train(ckpt, kill_at=None):
        seen, state = [], ckpt.state
        for epoch in ckpt.epochs(3):
            for i, b in enumerate(ckpt.batches(make(epoch))):
                if (epoch, i) == kill_at:
                    raise KeyError("killed")
                seen.append(b.numpy().tolist())
                state = ckpt.update({"w": state["w"] + jnp.asarray(b.numpy().sum(0))})
        return seen, state

    expected = [b.numpy().tolist() for e in range(3) for b in make(e)]
    run = functools.partial(DriveCheckpoint, tmp_path / "run", state={"w": jnp.zeros(2)}, every=2)
    first = run()
    with pytest.raises(KeyError):
        train(first, kill_at=(1, 2))
    first.close()
    err = capsys.readouterr().err
    assert err.count("has no state keepalive can save") == 1 and "a tf.data pipeline resumes exactly" in err, err
    ckpt = run(quiet=True)
    seen, state = train(ckpt)
    ckpt.close()
    assert ckpt.step == 12 and seen == expected[4:]
    assert np.array_equal(state["w"], np.sum(expected, axis=(0, 1)))
