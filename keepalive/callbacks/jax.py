"""``DriveCheckpoint`` for JAX / Flax training loops: Flax NNX objects, functional train states, Grain.

Wrap the epoch loop and the batch loop, as with the torch adapter; re-running the same cell or script
after a crash continues where the newest valid checkpoint left off, bit for bit.

NNX objects change in place: register them, and they are restored in place.

>>> import jax, jax.numpy as jnp, optax
>>> from flax import nnx
>>> from keepalive.callbacks.jax import DriveCheckpoint
>>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
>>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
>>> @nnx.jit
... def train_step(model, optimizer, x, y):
...     grads = nnx.grad(lambda m: ((m(x) - y) ** 2).mean())(model)
...     optimizer.update(model, grads)
>>> data = [(jnp.ones((8, 4)) * i, jnp.ones((8, 1))) for i in range(4)]
>>> ckpt = DriveCheckpoint("memory://doc/nnx", model=model, optimizer=optimizer, quiet=True)
>>> for epoch in ckpt.epochs(3):
...     for x, y in ckpt.batches(data):
...         train_step(model, optimizer, x, y)
>>> ckpt.step, ckpt.finished
(12, True)

A functional state (a Linen ``TrainState``, any pytree the loop rebinds) is handed to keepalive after
each step; ``ckpt.state`` is the one to start from (the restored one after a resume)::

    ckpt = DriveCheckpoint(path, state=state)
    state = ckpt.state
    for epoch in ckpt.epochs(5):
        for batch in ckpt.batches(loader):
            state, loss = train_step(state, batch)
            ckpt.update(state)

Steps: one optimizer step per ``ckpt.update(...)`` call; a loop that never calls it counts one per batch
of ``ckpt.batches()`` (so ``every=N`` counts them). Data: ``ckpt.batches()`` takes any iterable; a
Grain ``DataLoader`` / dataset iterator (through its ``get_state()`` / ``set_state()``) and a torch
``DataLoader`` (replayed) resume inside an epoch at the saved batch, anything else at epoch ends (said
once). Also saved: the host RNGs (python, numpy, torch), the loop's top-level variables (its PRNG key
``rng``, a history of metrics: :mod:`keepalive.loopstate`), ``ckpt.extras``, and the JAX PRNG
settings, which a resume checks.

The parts: the registered objects (``_jax_objects``, their arrays as keepalive stores them in
``_jax_arrays``), the training data (``_jax_data``) and the loops (``_jax_loop``); the framework
internals used are listed in ``_compat_jax``.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Optional, Tuple, Union

from ..adapter import CheckpointAdapter
from ..config import CheckpointConfig
from ..core import Checkpointer
from ..loopstate import LoopVariables, caller_frame
from ..statetree import Captured, StateTree
from ._compat_jax import COMPAT
from ._jax_data import TrainingData
from ._jax_loop import JaxLoop
from ._jax_objects import JaxObjects
from ._jax_orbax import attach as attach_orbax

__all__ = ["DriveCheckpoint"]


class DriveCheckpoint(CheckpointAdapter):
    """Checkpoint a JAX / Flax loop to a local folder, a mounted Drive or any fsspec URL.

    Args:
        path: the run folder (see :class:`keepalive.config.CheckpointConfig` for every option:
            ``every``, ``keep``, ``on_deadline``, ``spool``, ``quiet``, ...; or pass ``config=``).
        model, optimizer, metrics: NNX objects (``nnx.Module``, ``nnx.Optimizer``, ``nnx.MultiMetric``),
            saved through ``nnx.state`` and restored in place.
        state: a functional train state (a Linen ``TrainState``, any pytree of arrays): hand the new one
            over with ``ckpt.update(state)``; ``ckpt.state`` is the restored one after a resume.
        **objects: more NNX objects or functional states, saved under their names (keyword arguments
            that are not options).
    """

    def __init__(self, path: Union[str, "os.PathLike[str]", None] = None, *, model: Any = None,
                 optimizer: Any = None, metrics: Any = None, state: Any = None,
                 config: Optional[CheckpointConfig] = None, **options: Any):
        COMPAT.check()
        cfg, objects = CheckpointConfig.from_arguments(path, config, options)
        self.core = Checkpointer(config=cfg, framework="jax")
        self._objects = JaxObjects(self.core)
        self._data = TrainingData(self.core)
        self._vars = LoopVariables(self.core.say, self.core.warn, enabled=cfg.track_globals, track=cfg.track)
        self._vars.owned = self._objects.owns
        self._vars.managed_names = self._objects.trees.keys()  # `state = train_step(state, ...)` in a function
        self._loop = JaxLoop(self.core, self._data, self.capture, self.resume, self._vars.put_back,
                             lambda: self._capture(preview=True))
        for name, obj in (("model", model), ("optimizer", optimizer), ("metrics", metrics), ("state", state),
                          *objects.items()):
            if obj is not None:
                self.register(name, obj)

    # ---------------------------------------------------------------------------- registration
    def register(self, name: str, obj: Any) -> None:
        """Save and restore ``obj`` as ``name``: an NNX object (restored in place) or a functional
        state (a pytree of arrays the loop rebinds: hand each new one over with ``ckpt.update(name=...)``),
        or a private random generator the data order is drawn from (``np.random.Generator``,
        ``np.random.RandomState``, ``random.Random``: its state is saved and put back)."""
        if self._data.register_generator(name, obj):
            return
        self._objects.register(name, obj)
        attach_orbax(self.core, self._objects)  # several processes: spread arrays go through Orbax

    # ---------------------------------------------------------------------------------- resume
    def resume(self) -> bool:
        """Restore the newest valid checkpoint (once); True if one was. NNX objects are restored in
        place, functional states are then :attr:`state` / :meth:`get`.

        Called by :meth:`epochs` / :meth:`batches` / :attr:`state`; a checkpoint that does not fit the
        objects (other shapes, dtypes, PRNG settings) raises ``StateMismatchError`` and changes nothing.
        """
        if self._objects.after_resume:
            return self.core.resumed_from is not None
        tree = self.core.load(check=self._objects.check_fits)
        self._objects.after_resume = True
        if tree is None:
            return False
        self.restore(tree)
        return True

    def restore(self, tree: StateTree) -> None:
        """Put a loaded (and checked) tree into the objects, the host RNGs and the data position."""
        self._objects.restore(tree)
        self._data.restore(dict(tree))
        self._vars.loaded(tree.get("loop"))

    @property
    def state(self) -> Any:
        """The functional state registered as ``state``: the restored one after a resume, else the
        latest handed over (the one given at first)."""
        return self.get("state")

    def get(self, name: str) -> Any:
        """The functional state registered as ``name`` (restored first, if a checkpoint exists)."""
        self.resume()
        return self._objects.take(name)

    # ------------------------------------------------------------------------------------ loops
    def epochs(self, n: int) -> Iterator[int]:
        """``for epoch in ckpt.epochs(n)``: yields the epochs still to run, saving as configured."""
        self._vars.watch(caller_frame())
        return self._loop.epochs(n)

    def batches(self, iterable: Iterable, steps: Optional[int] = None) -> Iterator[Any]:
        """``for batch in ckpt.batches(iterable)``: the epoch's training batches from the saved position
        (any iterable: a Grain loader or iterator, a torch ``DataLoader``, a list, a generator). Without
        ``ckpt.epochs()`` around it, each pass is an epoch of the run (a loop of steps over one long
        iterator resumes inside it). ``steps``: the epoch's pass ends after that many batches, those
        done before a resume included (one iterator kept across epochs: ``ckpt.batches(it,
        steps=steps_per_epoch)``, where ``zip(range(k), ...)`` would count again from 0 after a resume)."""
        if not self._data.in_epochs:
            self._vars.watch(caller_frame())
        return self._loop.batches(iterable, steps)

    def enumerate(self, iterable: Iterable, steps: Optional[int] = None) -> Iterator[Tuple[int, Any]]:
        """Like :meth:`batches`, with the batch's true index in the epoch (a resumed epoch starts at
        the saved index)."""
        if not self._data.in_epochs:
            self._vars.watch(caller_frame())
        return self._loop.enumerate(iterable, steps)

    def update(self, *state: Any, **states: Any) -> Any:
        """After a training step: count one optimizer step and hand keepalive the new functional
        state(s): ``ckpt.update(state)`` (the one registered as ``state``, or the only one registered)
        or ``ckpt.update(state=..., ema=...)``; returns the state given (``state = ckpt.update(state)``
        reads well too). Without arguments it only counts the step (an NNX loop that steps twice per
        batch, or none in some)."""
        if len(state) > 1:
            raise TypeError("ckpt.update() takes one functional state positionally; name more: "
                            "ckpt.update(a=..., b=...)")
        if state:
            names = list(self._objects.trees)
            name = "state" if "state" in names or len(names) != 1 else names[0]
            states = {name: state[0], **states}
        for name, tree in states.items():
            self._objects.hand_over(name, tree)
        self._loop.stepped()
        return state[0] if state else (next(iter(states.values())) if len(states) == 1 else None)

    # ------------------------------------------------------------------------------- save/state
    def capture(self) -> Captured:
        return self._capture()

    def _capture(self, preview: bool = False) -> Captured:
        captured: Captured = {"objects": self._objects.states(preview), "data": self._data.section(),
                              "jax": self._objects.section()}
        stepped = self.core.optimizer_steps > 0 or self.core.counters["step"] > 0
        loop = self._vars.capture(tell=stepped and not preview)
        if loop is not None:
            captured["loop"] = loop
        return captured

    def state_dict(self) -> StateTree:
        """The whole training state as it would be saved now."""
        return self.core.build_tree(self.capture)

    def save(self, *, sync: bool = False) -> None:
        """Save now (in the background unless ``sync``). Inside the batch loop the save is made at the
        end of the running batch, where the counters describe the state exactly."""
        self.resume()
        if self._data.out or (self._data.in_epochs and self._data.feed is not None):
            self._data.save_requested = True
            return
        super().save(sync=sync)
        # the arrays are copied after save() returned: settled now, since the code's next line may be a
        # step that donates them (inside the loops, keepalive settles before handing out a batch)
        self.core.settle_snapshot()

    def log(self, **metrics: Any) -> None:
        """Record logged values (``ckpt.log(loss=loss.item(), acc=acc)``): numbers only, kept in the
        run's session record (its curve across sessions: ``keepalive report``) and as ``last_metrics``."""
        self.core.heartbeat.log(metrics)
