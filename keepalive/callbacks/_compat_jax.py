"""The JAX / Flax / Grain / Orbax names the JAX adapter relies on (``jax.py``, ``_jax_objects.py``,
``_jax_arrays.py``, ``_jax_data.py``, ``_jax_orbax.py``), and their check (:mod:`keepalive.callbacks._compat`).

Tested with jax 0.10.2, flax 0.12.8 (NNX), optax 0.2.8 and grain 0.2.18. Almost everything the adapter
uses is public API (``nnx.state`` / ``nnx.update`` / ``nnx.to_pure_dict`` /
``nnx.replace_by_pure_dict``, ``jax.random.key_data`` / ``wrap_key_data`` / ``key_impl``,
``jax.device_put``, the ``jax_default_prng_impl`` and ``jax_threefry_partitionable`` settings); they are
listed because a version without them cannot resume, and the check says so at ``DriveCheckpoint(...)``
rather than at the first resume. The one internal is the layout of a Grain ``DataLoader`` iterator's
state (JSON naming the data source by its ``repr``, which Grain compares on ``set_state``): a source
named by a default ``repr`` (an address, new in each process) is renamed to the live one's on resume.
Grain is checked only when it is imported (a loop fed by a torch ``DataLoader`` needs none of it).
Orbax (arrays spread over several ``jax.distributed`` processes) is checked only when it is imported:
its barriers are routed to the distributed client by naming every process active.
"""
from __future__ import annotations

from ._compat import Framework, Internal, Package, has

__all__ = ["COMPAT", "INTERNALS"]

_J, _O, _A, _D = "jax.py", "_jax_objects.py", "_jax_arrays.py", "_jax_data.py"

#: the internals, as a table: name, what the adapter does with it, where, the check
INTERNALS = (
    Internal("flax.nnx.state / update / replace_by_pure_dict", "an NNX object's state read as a pure dict and "
             "put back in place", f"{_O}: JaxObjects.states, restore",
             has("flax.nnx", "state", "update", "replace_by_pure_dict", "Pytree"), token="nnx.replace_by_pure_dict"),
    Internal("flax.nnx.to_pure_dict", "the state's arrays by path (keys and counts of nnx.Rngs included)",
             f"{_O}: JaxObjects._live", has("flax.nnx", "to_pure_dict"), token="nnx.to_pure_dict"),
    Internal("jax.random.key_data / wrap_key_data / key_impl", "a typed PRNG key saved as its data and its "
             "implementation's name, and rebuilt", f"{_A}: _host, _put",
             has("jax.random", "key_data", "wrap_key_data", "key_impl"), token="jax.random.wrap_key_data",
             package="jax"),
    Internal("jax.config.jax_default_prng_impl / jax_threefry_partitionable", "the PRNG settings a run's random "
             "numbers depend on (saved, checked on resume)", f"{_O}: prng_settings",
             has("jax:config", "jax_default_prng_impl", "jax_threefry_partitionable"), token="PRNG_SETTINGS",
             package="jax"),
    Internal("grain DataLoader iterator state 'data_source'", "the data source's repr in a DataLoader "
             "iterator's state: a default repr (an address) is renamed to the live one's on resume",
             f"{_D}: _same_source", has("grain._src.python.data_loader", "_DATA_SOURCE"), token='"data_source"',
             package="grain", required=False),
    Internal("orbax.checkpoint.options.MultiprocessingOptions(active_processes=...)", "Orbax's save and restore of "
             "the arrays spread over several jax.distributed processes meet at the distributed client's barriers "
             "(every process named active) instead of sync_global_devices, a device collective that would "
             "interleave with the training step's from the save's background thread",
             "_jax_orbax.py: _checkpointer", has("orbax.checkpoint.options", "MultiprocessingOptions"),
             token="MultiprocessingOptions", package="orbax-checkpoint"),
)


COMPAT = Framework("jax", [Package("flax", "flax", ">=0.12,<0.13"), Package("jax", "jax", ">=0.7"),
                           Package("grain", "grain", ">=0.2.12", only_if_imported=True),
                           Package("orbax-checkpoint", "orbax.checkpoint", ">=0.11.27", only_if_imported=True)],
                    INTERNALS)
