"""``dpkern finetune --nproc N``: N spawned worker processes, one data-parallel rank each
(see the finetune module's docstring). The parent forwards SIGINT / SIGTERM to its
workers; the ranks agree on the step to stop at, and rank 0 checkpoints."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ...distributed.processes import end_worker, finished_before_dying, mark_finished
from ..stop import StopSignals
from .checkpoint import UsageError
from .clipping import Ghost
from .job import Job, make_optimizer, prepare


def run(args: argparse.Namespace) -> int:
    """Run ``dpkern finetune``; returns the exit code: 0; 2 for bad input (a one-line
    error on stderr, nothing written); 130 / 143 when SIGINT / SIGTERM stopped it at a
    step boundary (checkpointed to --out, one line on stderr)."""
    try:
        return _run(args)
    except UsageError as exc:
        print(f"dpkern finetune: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    job = prepare(args)
    if getattr(args, "nproc", 1) > 1:
        del job  # everything is validated: the workers build their own copies
        return spawn(args)
    with StopSignals() as stop:  # SIGINT / SIGTERM: stop at a step boundary
        return train_with_warnings(args, job, stop=stop)


def train_with_warnings(args, job: Job, dist_ctx=None, stop: StopSignals | None = None) -> int:
    def show_warning(message, category, filename, lineno, file=None, line=None):
        print(f"dpkern finetune: warning: {message}", file=sys.stderr)

    if job.device.type == "cpu":  # (each worker of --nproc too: its own process)
        from ..heap import keep_freed_memory, user_settings

        mine = [] if keep_freed_memory() else user_settings()
        if mine and not getattr(args, "quiet", False):
            print(
                f"dpkern finetune: note: {', '.join(mine)} set: glibc's heap is "
                "left as configured (dpkern would keep freed memory; see README, 'Page "
                "faults')",
                file=sys.stderr,
            )
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        warnings.filterwarnings("ignore", module="opacus")
        from .loop import run_training

        return run_training(args, job, dist_ctx=dist_ctx, stop=stop or StopSignals())


def spawn(args) -> int:
    """Run the validated job in ``args.nproc`` worker processes; rank 0's exit code."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    workers = []

    def forward(signum):  # SIGINT / SIGTERM to the parent: every worker stops (they agree
        for p in workers:  # on the step), rank 0 checkpoints; sent twice, it is one stop
            if p.is_alive():
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass

    with (
        tempfile.TemporaryDirectory(prefix="dpkern-finetune-") as tmp,
        StopSignals(on_signal=forward) as stop,
    ):
        ctx = mp.start_processes(
            _worker,
            args=(args.nproc, tmp, args),
            nprocs=args.nproc,
            join=False,
            start_method="spawn",
        )
        workers.extend(ctx.processes)
        if stop.requested:  # it came while they were being started
            forward(stop.signum)
        rc = Path(tmp, "rc0")
        try:
            while not ctx.join(grace_period=EXIT_GRACE_SECONDS):
                pass
        except ProcessException as exc:
            if finished_before_dying(exc, tmp, args.nproc, prefix="rc"):
                print(
                    f"dpkern finetune: note: worker {exc.error_index} was killed by "
                    f"{exc.signal_name} at interpreter exit, after every rank had finished "
                    "and recorded its result (torch's gloo teardown); the run is complete",
                    file=sys.stderr,
                )
                return int(rc.read_text())
            if stop.requested and not rc.is_file():  # stopped before their handlers were up
                print(
                    f"dpkern finetune: stopped by {stop.name} while the workers were "
                    "starting: nothing trained, nothing saved",
                    file=sys.stderr,
                )
                return stop.exit_code
            print(f"dpkern finetune: error: a worker process failed: {exc}", file=sys.stderr)
            return 1
        finally:
            for p in ctx.processes:
                if p.is_alive():  # (SIGTERM would only ask it to stop at a step boundary)
                    p.kill()
        if rc.is_file():
            return int(rc.read_text())
        return stop.exit_code if stop.requested else 1


#: After one worker ends with an error, the others get this long to finish on their own
#: before they are terminated (a rank that died at exit must not cut rank 0's save short).
EXIT_GRACE_SECONDS = 30.0


def _worker(rank: int, world: int, tmp: str, args) -> None:
    """One data-parallel rank: rebuild the job, join the group, train, record the code."""
    with StopSignals() as stop:  # before anything else: the parent forwards its signals
        _worker_run(rank, world, tmp, args, stop)
    end_worker()  # (past gloo's occasional abort at interpreter exit)


def _worker_run(rank: int, world: int, tmp: str, args, stop: StopSignals) -> None:
    import contextlib
    import io

    import torch.distributed as dist

    from ...distributed import DistributedDPOptimizer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    args = argparse.Namespace(**vars(args))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        args.device = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    args.writes = args.out is not None or args.resume is not None  # rank 0 checkpoints
    if rank != 0:
        args.quiet, args.out = True, None
        if not args.fsdp:  # (FSDP: every rank joins the checkpoint's gathers)
            args.save_every = None
    with contextlib.redirect_stderr(io.StringIO()):  # notes were shown before spawning
        job = prepare(args)
    if rank != 0:
        job.out = None
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{os.path.join(tmp, 'rendezvous')}",
        rank=rank,
        world_size=world,
    )
    try:
        with torch.no_grad():  # one model: rank 0's init (secure mode draws it per rank)
            for t in job.model.state_dict().values():
                dist.broadcast(t, src=0)
        if args.fsdp:
            _shard(job, args, world)
        else:
            job.optimizer = DistributedDPOptimizer(job.optimizer)  # broadcasts the key
        code = train_with_warnings(args, job, dist_ctx=(rank, world), stop=stop)
        mark_finished(tmp, rank, str(code), prefix="rc")
    finally:
        dist.destroy_process_group()


def _shard(job: Job, args, world: int) -> None:
    """--fsdp: shard the (broadcast) model with FSDP2 -- one unit per transformer block,
    then the root -- and rebuild the optimizer over the DTensor shards (a resumed run's
    full optimizer state is cut to this rank's rows) and ghost clipping over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ...distributed import DistributedDPOptimizer

    model, plan = job.model, job.plan
    full_state = job.optimizer.state_dict() if job.done else None
    job.per_sample.gc.detach()
    mesh = init_device_mesh(job.device.type, (world,))
    blocks = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)), [])
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = DistributedDPOptimizer(
        make_optimizer(plan, params, args.backend, plan.noise_multiplier)
    )
    if full_state is not None:
        optimizer.load_state_dict(full_state)
        optimizer.noise_multiplier = plan.noise_multiplier
    job.optimizer = optimizer
    job.per_sample = Ghost(job.net, optimizer, placeholder=job.train[:1])


def check_replicas(model, world: int, device) -> None:
    """Every rank must end with the same parameters (same init, same all-reduced sums,
    same noise): compare per-parameter float64 sums across ranks, exactly (a collective).

    Raises DistributedDPError on every rank if the replicas diverged."""
    import torch.distributed as dist

    from ...distributed import DistributedDPError

    sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).to(device)
    rows = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(rows, sums)
    bad = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
    if bad:
        raise DistributedDPError(f"model replicas diverged: ranks {bad} differ from rank 0")
