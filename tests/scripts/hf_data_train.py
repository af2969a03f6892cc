"""A masked-LM ``Trainer`` run for the HF adapter's data crash tests (``tests/scripts/hf_setup.py``: a tiny BERT,
``DataCollatorForLanguageModeling`` masking while batches are made, dropout, accumulation 2). Prints ``STEP n``
after each optimizer step and ``COMMITTED n`` after each keepalive commit; at the end writes the weights, the
optimizer state and the log history (without timings).

``--data map|stream|hfstream``, ``--workers N``; ``--plain``: no callback (the reference run).
"""
import os

import hf_script
import hf_setup
import torch

p = hf_script.arguments()
p.add_argument("--data", default="map", choices=["map", "stream", "hfstream"])
p.add_argument("--workers", type=int, default=0)
p.add_argument("--every", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(1)

ckpt = None if args.plain else hf_script.drive_checkpoint(args.run, every=args.every)
trainer = hf_setup.trainer(os.path.join(os.path.dirname(args.out), "hf-unused"), ckpt, data=args.data,
                           workers=args.workers, extra_callbacks=[hf_script.Steps(args.sleep)])
trainer.train()
hf_script.write_results(trainer, args.out, optimizer=True)
