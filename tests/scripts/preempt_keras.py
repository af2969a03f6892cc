"""A small Keras ``model.fit`` with a slow validation, checkpointed by keepalive, for the tests of saves
between steps (tests/test_preempt_keras.py): ``python preempt_keras.py RUN_DIR OUT_FILE``.

TensorFlow backend (as the other Keras crash tests). 3 epochs of 8 batches (ResumableData: 64 samples,
batch 8, shuffled per epoch), dropout, Adam, ReduceLROnPlateau on val_loss (its state changes at each
epoch end, so an epoch end run twice or not at all shows), validation on 8 batches after each epoch.
Prints ``STEP n`` after each optimizer step, ``LOSS e b <hex>`` per training batch, ``EPOCH e <loss hex>
<val_loss hex> <lr hex>`` per epoch end, ``EVAL START e`` / ``EVAL END e`` around the slow validation,
``COMMITTED n`` per checkpoint commit; at the end it saves every model and optimizer variable and a last
random draw (NumPy, Keras' global SeedGenerator) to OUT_FILE (.npz) and prints ``DONE``.

Environment (test knobs):
KE_PLAIN=1: the same training without keepalive (the reference).
KE_SLOW_EPOCH (1), KE_EVAL_SECONDS (8): that epoch's validation sleeps that long in all, in a callback
    listed after DriveCheckpoint (its hook runs after keepalive's, as a slow metric would).
KE_DEADLINE=s: the session's deadline comes s seconds after the slow validation starts.
KE_EMA_SWAP=1: Adam(use_ema=True) and Keras' SwapEMAWeights, which puts the EMA weights into the model
    for each validation (the state is no longer that of the last step: the save waits for the epoch end).
KE_NO_PAUSE_SAVE=1: negative control: saves between steps switched off.
KE_SLOW_LAST_BATCH=s: the last training batch of epoch KE_SLOW_EPOCH takes s seconds more, in a callback
    listed before DriveCheckpoint (prints ``LAST BATCH e``): a signal then comes during that batch.
"""
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from childio import emit  # noqa: E402

EPOCHS = 3


def knob(name, default):
    return type(default)(os.environ.get(name, default))


class Losses(keras.callbacks.Callback):
    """Listed first: each batch's loss is printed before keepalive's hook (which may exit after it)."""

    def __init__(self):
        super().__init__()
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        emit(f"LOSS {self.epoch} {batch} {float(logs['loss']).hex()}")
        emit(f"STEP {int(self.model.optimizer.iterations.numpy())}")


class Report(keras.callbacks.Callback):
    """The lines the test reads, and the slow validation of one epoch."""

    def __init__(self, slow_epoch: int, eval_seconds: float, deadline: list):
        super().__init__()
        self.slow_epoch, self.eval_seconds, self.deadline = slow_epoch, eval_seconds, deadline
        self.epoch, self.slow = 0, False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_test_begin(self, logs=None):
        self.slow = self.epoch == self.slow_epoch and self.eval_seconds > 0
        if not self.slow:
            return
        emit(f"EVAL START {self.epoch}")
        if os.environ.get("KE_DEADLINE"):
            self.deadline[0] = time.time() + knob("KE_DEADLINE", 0.0)

    def on_test_batch_end(self, batch, logs=None):
        if self.slow:
            time.sleep(self.eval_seconds / 8)

    def on_test_end(self, logs=None):
        if self.slow:
            emit(f"EVAL END {self.epoch}")
        self.slow = False

    def on_epoch_end(self, epoch, logs=None):
        lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        emit(f"EPOCH {epoch} {float(logs['loss']).hex()} {float(logs['val_loss']).hex()} {lr.hex()}")


class SlowLastBatch(keras.callbacks.Callback):
    """Listed before DriveCheckpoint: the slow epoch's last training batch ends ``seconds`` later."""

    def __init__(self, epoch: int, seconds: float):
        super().__init__()
        self.slow_epoch, self.seconds, self.epoch = epoch, seconds, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.slow_epoch and batch == self.params["steps"] - 1:
            emit(f"LAST BATCH {self.epoch}")
            time.sleep(self.seconds)


def main(run_dir: str, out_file: str) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.experimental.enable_op_determinism()
    if os.environ.get("KE_NO_PAUSE_SAVE"):
        import keepalive.pauses
        from keepalive.core import Checkpointer

        keepalive.pauses.PAUSE_SECONDS = 1e9  # the guard's thread never finds a pause
        Checkpointer._pause_save = lambda self, capture, in_thread: None  # nor does the training thread
    from keepalive.callbacks.keras import DriveCheckpoint, ResumableData

    keras.utils.set_random_seed(1234)
    rs = np.random.RandomState(7)  # the data itself never depends on the training seed
    x, y = rs.randn(64, 6).astype("float32"), rs.randn(64, 1).astype("float32")
    xv, yv = rs.randn(32, 6).astype("float32"), rs.randn(32, 1).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    ema = bool(os.environ.get("KE_EMA_SWAP"))
    model.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=ema, ema_overwrite_frequency=None), loss="mse")
    deadline = [None]
    callbacks = []
    ckpt = None
    if not os.environ.get("KE_PLAIN"):
        options = {}
        if os.environ.get("KE_DEADLINE"):
            options.update(remaining_fn=lambda: 1e6 if deadline[0] is None else deadline[0] - time.time(),
                           deadline_margin="2s")
        ckpt = DriveCheckpoint(run_dir, every="epoch", **options)
        ckpt.core.on_commit.append(lambda r: emit(f"COMMITTED {r.info.step}"))
        callbacks.append(ckpt)
    if knob("KE_SLOW_LAST_BATCH", 0.0):
        callbacks.insert(0, SlowLastBatch(knob("KE_SLOW_EPOCH", 1), knob("KE_SLOW_LAST_BATCH", 0.0)))
    callbacks.insert(0, Losses())
    callbacks += [Report(knob("KE_SLOW_EPOCH", 1), knob("KE_EVAL_SECONDS", 8.0), deadline),
                  keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=1e9)]
    if ema:  # after keepalive's callback: it swaps when the validation has begun
        callbacks.append(keras.callbacks.SwapEMAWeights(swap_on_epoch=False))
    data = ResumableData(x, y, batch_size=8)
    if os.environ.get("KE_PLAIN"):  # each epoch's order, as DriveCheckpoint binds it per pass
        bind = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: setattr(data, "epoch", epoch))
        callbacks.insert(0, bind)
    # shuffle=False: ResumableData shuffles per epoch itself (Keras' batch shuffle would reorder the plain run's)
    try:
        model.fit(data, validation_data=(xv, yv), validation_batch_size=4, epochs=EPOCHS, callbacks=callbacks,
                  verbose=0, shuffle=False)
    except SystemExit:  # keepalive's exit (143) after a SIGTERM or a stop before the end
        if ckpt is not None and ckpt.stopped:
            emit(f"STOPPED {ckpt.core.counters['step']}")
        raise
    arrays = {f"model.{i}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)}
    arrays.update({f"optimizer.{i}": np.asarray(v.numpy()) for i, v in enumerate(model.optimizer.variables)})
    arrays["draw.numpy"] = np.random.rand(4)
    arrays["draw.keras"] = keras.ops.convert_to_numpy(keras.random.uniform((4,)))
    np.savez(out_file, **arrays)
    emit("DONE")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
