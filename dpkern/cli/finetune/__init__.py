"""Private fine-tuning of a causal language model (the main job).

Trains a causal LM on text with a DP optimizer of dpkern: Poisson-sampled batches of
fixed-length blocks, per-sample clipping (by default ghost clipping; --clipping per-sample
materialises per-sample gradients with torch.func or Opacus' GradSampleModule), Gaussian
noise + update in one fused step, and an accountant (dp-accounting)
that reports the epsilon spent. The noise multiplier sigma is calibrated so that the
target epsilon is reached exactly at the end of training.

Defaults: a small byte-level GPT-2 (2 layers, width 128, block 64, ~0.44 M parameters)
built in code, trained on CPython's pydoc_data help pages (~465 kB of English prose,
offline), 150 steps of DP-AdamW (lr 5e-3; each --optimizer has its own default lr, see
--lr) at an expected batch of 128 blocks
(micro-batches of 64), epsilon = 8, delta = 1/N^1.1 (N = training blocks), C = 1.
About 45 s on 2 idle CPU cores; validation perplexity goes from about 240 to about 14.

Privacy unit (--privacy-unit): by default one block of --block-size tokens (adding or
removing one block of the training text). With "document" (a .jsonl line, or a topic of
the default corpus) or "user" (all lines with the same --user-field value), each unit's
text is cut into blocks of its own, units are Poisson-sampled (--batch-size is then the
expected number of units per step, delta's default 1/N^1.1 counts units), and the
gradients of a unit's blocks are summed and clipped as one row (per-sample clipping:
ghost clipping clips blocks alone), so the guarantee is about adding or removing a whole
document or user. The summary and metrics.json name the unit and the number of units.

Fixed shapes (--max-batch-size B_MAX): each Poisson batch is truncated to B_MAX blocks
(whole units, in a random order) and padded to B_MAX; the padding is masked out of the
losses, the norms and the counts. The accountant adds (1 + e^epsilon) * T * P[a batch
exceeds B_MAX] to delta and metrics.json reports it (delta_batch_truncation); sigma is
calibrated for the target delta less that charge (delta_mechanism), so the total stays
within the target; a B_MAX
below the expected batch, or one whose truncation would cost more than a tenth of
delta, is refused. The training loss on the progress bar is computed on the private data
without noise: it is for the operator and is written to no file. The validation losses in
metrics.json and the summary are exact on the held-out split: publish them only if that
split may be public. No
exact data-dependent count (samples drawn, clipped or non-finite) is written or shown:
throughput is that of the expected batch.

Models and memory: --arch llama builds a byte-level Llama (rotary, RMSNorm, SwiGLU,
grouped-query attention) instead of the GPT-2 default; --lora R trains peft LoRA adapters
only (they alone are clipped, noised and saved; --model on such a run's directory is its
base with the adapters merged in, or with --lora R its adapters, trained further);
--bf16 keeps the weights in bfloat16
(norms, sums, noise and optimizer states stay float32); --gradient-checkpointing recomputes
the blocks in the backward (ghost clipping stays exact). After the first step every
trainable parameter must have moved (else an error: the Opacus-820 trap). The summary ends
with a greedy sample from a fixed public prompt (metrics.json: "sample").

Seeds: --seed fixes the model init, the Poisson sampling (its key is derived from the
seed; without --seed it is a secret drawn from os.urandom) and dropout; the noise key stays
secret (os.urandom, never saved) unless --noise-seed is given, which makes the noise
reproducible and the run NOT private (whoever knows the key can subtract the noise): its
outputs say "not private: the noise key is known" instead of claiming an epsilon.

Output: --out DIR is written file by file (each file complete before it replaces the
old one); files dpkern did not write are kept. --overwrite replaces only a dpkern run
directory, never the current directory or one that holds --data or --model. SIGINT and
SIGTERM (a preemption) stop at the next step boundary: checkpoint, one line, exit code
130 / 143 (with --nproc too); --resume DIR continues.

examples:
  dpkern finetune                                    # the default run described above
  dpkern finetune --data notes.jsonl --epsilon 3 --out run1
  dpkern finetune --model ./my-gpt2 --data notes.txt --steps 500 --out run2
  dpkern finetune --resume run2 --steps 800 --epsilon 4   # continue (sigma recalibrated)
  dpkern finetune --arch llama --lora 8 --bf16 --out run5   # LoRA on a bf16 Llama
  dpkern finetune --nproc 4 --out run3               # data-parallel, 4 processes
  dpkern finetune --nproc 4 --fsdp --out run4        # the same, parameters sharded (FSDP2)

Data parallelism (--nproc N > 1): N worker processes (torch.multiprocessing, file://
rendezvous in a temp dir; gloo on CPU, NCCL on CUDA with rank r on cuda:r) build the same
model and data; rank 0's parameters are broadcast. Each rank Poisson-samples its shard of
the training units with the global rate q (dpkern.distributed.DistributedPoissonSampler),
and dpkern.distributed.DistributedDPOptimizer all-reduces the clipped sums once per step
and adds the same noise on every rank (secure key drawn on rank 0 and broadcast), so the
mechanism, sigma and the accounting are those of the single-process run. Only rank 0
shows progress and writes --out. Sampling is counter-based, so with the same --seed the
ranks together take exactly the single-process batches (and with the same --noise-seed
the same steps, up to the float summation order).

--fsdp (with --nproc N): parameters, gradients and optimizer state are sharded over the N
processes (FSDP2 fully_shard, one unit per transformer block plus the root) instead of
replicated: each rank keeps 1/N of the model and of the optimizer state between steps
and draws the noise of its shard at the shard's global indices, so the step is the DDP
step. Clipping is ghost clipping (the book-kept clipped sums are reduce-scattered);
every rank runs the same number of micro-batches (a rank without samples runs a
placeholder whose loss is dropped). Checkpoints gather the full model and optimizer
state, so --resume works with or without --fsdp.

Modules: options.py (the options and their checks), plan.py (the run plan,
run_config.json), clipping.py (per-sample gradients or ghost clipping), job.py (every
check, then the Job a run trains with), launch.py (one process or --nproc workers),
loop.py (the training loop, metrics, summary), checkpoint.py (run directories and
checkpoint files); dpkern.cli.stop handles SIGINT / SIGTERM.
"""

from __future__ import annotations

from .checkpoint import FILES, UsageError
from .launch import run
from .options import add_arguments
from .plan import NOT_PRIVATE

__all__ = ["FILES", "NOT_PRIVATE", "UsageError", "add_arguments", "run"]
