"""Where a JAX loop's training data is, and where a resumed epoch continues.

``ckpt.batches(iterable)`` takes any iterable; how far a resume can position it depends on what it is
(:class:`Feed`):

* a Grain ``DataLoader`` / ``MapDataset`` / ``IterDataset`` or one of their iterators (anything whose
  iterator has ``get_state()`` / ``set_state()``): its own checkpointable state, saved with each
  checkpoint; a resume inside an epoch continues at the saved element (nothing is read twice);
* a torch ``DataLoader``: keepalive's replay of its order (:class:`._torch_replay.LoaderReplay`, as the
  torch and Lightning adapters do): the skipped batches are never loaded;
* a list or tuple of batches (its order is the code's): continued at the saved index;
* a Python generator made anew in each epoch (``ckpt.batches(batches(rng))``) while a private random
  generator is registered (``DriveCheckpoint(..., data_rng=rng)``: a ``np.random.Generator``,
  ``np.random.RandomState`` or ``random.Random``, :class:`Generators`): it is taken as drawing its
  order from those generators, so a resume puts them back at the epoch's start, lets the rebuilt
  generator run past the batches done (read and dropped) and puts them at the saved step;
* anything else (a generator without a registered random generator, one kept across epochs, a
  ``tf.data.Dataset``): checkpoints at epoch ends only, said once at the first save (for tf.data with
  what makes its epoch-end resumes exact: an order the code sets in each epoch).

The first ``ckpt.batches()`` pass of an epoch is its training data; later ones in the same epoch (an
evaluation) are iterated as they are. :class:`TrainingData` keeps the epoch's host random state (the
code between ``for epoch`` and ``for batch`` replays with the epoch's starting state on a resume) and
puts back the saved step's once the resumed pass is positioned.
"""
from __future__ import annotations

import json
import re
import sys
import types
from typing import Any, Callable, Dict, Iterator, Optional

from .. import rng
from ..core import Checkpointer

__all__ = ["Feed", "Generators", "TrainingData"]

#: a default ``object.__repr__`` (``<pkg.Source object at 0x7f...>``): another one in every process
_DEFAULT_REPR = re.compile(r"^<\S+ object at 0x[0-9a-f]+>$")


def _torch_loader(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.utils.data.DataLoader)


def _stateful(it: Any) -> bool:
    return callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


def _same_source(saved: Any, live: Any) -> Any:
    """A Grain ``DataLoader`` state whose data source is named by a default ``repr`` (an address, new in
    every process, which Grain's check would refuse) with the live loader's name for it: the source
    is the same class at another address."""
    if not isinstance(saved, (bytes, str)) or not isinstance(live, (bytes, str)):
        return saved
    try:
        a, b = json.loads(saved), json.loads(live)
    except ValueError:
        return saved
    source = "data_source"  # Grain's DataLoader state: the source's repr, compared by set_state
    old, new = a.get(source), b.get(source) if isinstance(b, dict) else None
    if isinstance(a, dict) and isinstance(old, str) and isinstance(new, str) and old != new and \
            _DEFAULT_REPR.match(old) and _DEFAULT_REPR.match(new) and old.split(" at ")[0] == new.split(" at ")[0]:
        a[source] = new
        text = json.dumps(a, indent=4)
        return text.encode() if isinstance(saved, bytes) else text
    return saved


class Generators:
    """The private random generators registered for the data order (``data_rng=rng``): their states in
    :func:`keepalive.rng.generator_state`'s format, as every adapter saves them."""

    KINDS = rng.GENERATORS

    def __init__(self) -> None:
        self.live: Dict[str, Any] = {}

    def states(self) -> Dict[str, Any]:
        return {name: rng.generator_state(g) for name, g in self.live.items()}

    def load(self, states: Optional[Dict[str, Any]]) -> None:
        for name, state in (states or {}).items():
            if name in self.live:
                rng.set_generator_state(self.live[name], state)


class Feed:
    """One iterable handed to ``ckpt.batches()``: how it is iterated, saved and positioned."""

    def __init__(self, source: Any, rebuilt: bool = False):
        self.source = source
        self.replay: Any = None
        self.iterator: Any = None
        if _torch_loader(source):
            from ._torch_replay import LoaderReplay

            self.replay = LoaderReplay(source)
            self.kind = "torch" if self.replay.mid_epoch else "epoch"
            self.why_not = self.replay.why_not
        elif isinstance(source, (list, tuple)):
            self.kind = "sequence"
            self.why_not = ""
        elif rebuilt and isinstance(source, types.GeneratorType):
            self.kind = "rebuilt"  # drawn from the registered generators: run again past the batches done
            self.why_not = ""
        else:
            self.kind = "grain" if _stateful(source) else "probe"  # "probe": known once its iterator is made
            self.why_not = ""
        #: the iterable is its own iterator (a Grain iterator the loop keeps across epochs); not asked
        #: through iter(), which starts a Grain DataLoader's workers
        self.persistent = self.replay is None and hasattr(source, "__next__")
        self.samples = 0  # a torch loader's samples handed out in this pass (its replay skips by them)

    @property
    def mid_epoch(self) -> bool:
        return self.kind in ("grain", "torch", "sequence", "rebuilt")

    def open(self, start: Optional[Dict[str, Any]], positioned: Callable[[], None]) -> Iterator[Any]:
        """The pass's batches, from ``start`` (a saved :meth:`position`) when given."""
        if self.replay is not None:
            self.samples = int(start["samples"]) if start else 0
            return self._replayed(start if self.kind == "torch" else None, positioned)
        if self.kind == "sequence":
            skip = int(start["batches"]) if start else 0
            if start is not None:
                positioned()
            return iter(self.source[skip:])
        it = iter(self.source)
        if self.kind == "rebuilt" and start is not None:
            for _ in zip(range(int(start["batches"])), it):
                pass  # the batches done before the resume, drawn again from the epoch's start and dropped
        self.iterator = it
        if self.kind == "probe":
            self.kind = "grain" if _stateful(it) else "epoch"
        if self.kind == "epoch":
            self.why_not = (f"a {type(self.source).__name__} has no state keepalive can save (no get_state() / "
                            "set_state()): checkpoints at epoch ends only. Pass a Grain DataLoader / dataset "
                            "iterator or a torch DataLoader to ckpt.batches() for saves inside an epoch")
            if self.persistent:
                self.why_not += ("; an iterator kept across epochs restarts on a resume: make it anew in each "
                                 "epoch (ckpt.batches(make_batches(epoch)))")
            if type(self.source).__module__.startswith("tensorflow"):
                self.why_not += ("; a tf.data pipeline resumes exactly at an epoch end when its order is set by "
                                 "the code: made in each epoch with a seeded shuffle (shuffle(n, seed=base + "
                                 "epoch)) or with reshuffle_each_iteration=False (one reshuffled by each iteration "
                                 "starts its order over after a resume)")
            if isinstance(self.source, types.GeneratorType):
                self.why_not += ("; a generator made in each epoch that draws its order from a random generator "
                                 "of its own resumes inside the epoch once that one is registered "
                                 "(DriveCheckpoint(..., data_rng=rng))")
        if start is not None and start.get("state") is not None and self.kind == "grain":
            it.set_state(_same_source(start["state"], it.get_state()))
        if start is not None:
            positioned()
        return it

    def _replayed(self, start: Optional[Dict[str, Any]], positioned: Callable[[], None]) -> Iterator[Any]:
        for batch, n in self.replay.iterate(start, positioned):
            self.samples += n
            yield batch

    def position(self, batches: int) -> Dict[str, Any]:
        """Where the pass is, after ``batches`` batches (what a checkpoint saves of it)."""
        if self.replay is not None and self.kind == "torch":
            return self.replay.position(self.samples, batches)
        state = self.iterator.get_state() if self.kind == "grain" and self.iterator is not None else None
        return {"batches": batches, "state": state}


class TrainingData:
    """The epoch's training feed, its position, and the host random state of a resumed epoch."""

    def __init__(self, core: Checkpointer):
        self.core = core
        self.feed: Optional[Feed] = None      # the training pass's feed of the running epoch
        self.done = 0                         # its batches handed out
        self.out = False                      # a batch handed out whose boundary has not come
        self.in_epochs = False
        self.saved: Dict[str, Any] = {}       # the loaded checkpoint's data section
        self.step_rng: Optional[Dict[str, Any]] = None   # the saved step's random state (mid-epoch)
        self.epoch_rng: Optional[Dict[str, Any]] = None  # the running epoch's at its start
        self.save_requested = False
        self.feeds: Dict[int, Feed] = {}      # by id of the iterable: a loader keeps its feed
        self.persistent_state: Any = None     # a kept iterator's state at an epoch end
        self.resumed_at = 0                   # the batch a resumed epoch's pass continued at (0: none)
        self.generators = Generators()        # the private ones the data order is drawn from
        self.step_generators: Optional[Dict[str, str]] = None   # their states at the saved step (mid-epoch)
        self.epoch_generators: Dict[str, str] = {}              # theirs at the running epoch's start

    def register_generator(self, name: str, obj: Any) -> bool:
        """``obj`` is a private random generator (``data_rng=rng``): kept here (True), saved with the data."""
        if not isinstance(obj, Generators.KINDS):
            return False
        self.generators.live[name] = obj
        return True

    def restore(self, tree: Dict[str, Any]) -> None:
        self.saved = dict(tree.get("data") or {})
        self.core.restore_rng(tree)
        generators = self.saved.get("generator_states")
        if self.core.counters["batch"]:
            self.step_rng = tree.get("rng")
            self.step_generators = generators  # put back once the rebuilt pass is past the batches done
        else:
            self.generators.load(generators)
        self.persistent_state = self.saved.get("kept_state")

    def begin_epoch(self) -> None:
        """An epoch begins: a resumed one with the random state its start had."""
        self.feed, self.done, self.out, self.resumed_at = None, 0, False, 0
        epoch_rng = self.saved.pop("epoch_rng", None) if self.core.counters["batch"] else None
        if epoch_rng is not None:
            rng.restore(epoch_rng)
            self.generators.load(self.saved.pop("epoch_generators", None))
        self.epoch_rng = rng.capture()
        self.epoch_generators = self.generators.states()

    def take_request(self) -> bool:
        requested, self.save_requested = self.save_requested, False
        return requested

    def training_feed(self, source: Any) -> Feed:
        feed = self.feeds.get(id(source))
        if feed is not None and feed.source is source and feed.kind == "rebuilt":
            feed.kind = "probe"  # a generator kept across epochs: run again, it would start over (epoch ends)
        if feed is None or feed.source is not source:
            feed = self.feeds[id(source)] = Feed(source, rebuilt=bool(self.generators.live))
            generators = self.saved.pop("generators", None)
            if generators and feed.replay is not None and not self.core.counters["batch"]:
                feed.replay.load_generators(generators)  # an epoch-end checkpoint: the next epoch's start
        self.feed = feed
        return feed

    def start(self, feed: Feed) -> Optional[Dict[str, Any]]:
        """Where the training pass continues (once): the saved position of a mid-epoch checkpoint, or
        the state a kept iterator had at the saved epoch end."""
        position = self.saved.pop("position", None)
        if self.core.counters["batch"] and position is not None:
            self.done = self.resumed_at = int(position.get("batches", 0))
            return dict(position)
        kept, self.persistent_state = self.persistent_state, None
        if feed.persistent and kept is not None:
            return {"batches": 0, "state": kept}
        return None

    def positioned(self) -> None:
        """A resumed pass is at its saved place: the random state of the saved step, once."""
        if self.step_rng is not None:
            rng.restore(self.step_rng)
            self.step_rng = None
        if self.step_generators is not None:
            self.generators.load(self.step_generators)
            self.step_generators = None

    def section(self) -> Dict[str, Any]:
        """The checkpoint's ``data`` section."""
        feed = self.feed
        data: Dict[str, Any] = {}
        if feed is not None and feed.kind == "epoch":
            self.core.warn(feed.why_not, key=f"jax-feed:{type(feed.source).__name__}")
        if self.generators.live:
            data["generator_states"] = self.generators.states()
        if self.core.counters["batch"] and feed is not None:
            data.update(position=feed.position(self.done), epoch_rng=self.epoch_rng,
                        epoch_generators=self.epoch_generators)
        elif feed is not None and feed.persistent and feed.kind == "grain":
            data["kept_state"] = feed.position(self.done)["state"]
        if not self.core.counters["batch"]:
            data["generators"] = next((f.replay.generators_now() for f in self.feeds.values()
                                       if f.replay is not None), None)
        return data
