"""The training run, top to bottom (as DeiT's main.py): set-up from a :class:`TrainConfig`, resume, the epoch loop,
checkpoints and export.

``_start`` builds the run (:func:`~.build.assemble`: one :class:`~.build.Run`, the one object the loop passes) and
resumes it (:func:`~.checkpoint.restore` gives its :class:`~.checkpoint.Progress`); ``_train`` then reads as timm's
and DeiT's mains: per epoch one training pass (:mod:`.engine`, an :class:`~.engine.EpochResult`), evaluation, and
the checkpoint; a stop request checkpoints inside the epoch. Logging is rank 0's (:mod:`.runlog`).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any, Dict, List, Optional, Union

import torch
from timm.utils import random_seed

from ..console import run_command
from ..models import ModelName, layer_key_dim
from ..weights_io import WeightsError, WriteError, export_safetensors, torch_load
from .build import Run, assemble, scaled_lr
from .checkpoint import (SAMPLE_ORDER, check_geometry, check_run_dir, check_same_run, checkpoint_state, gather_rng,
                         load_training_checkpoint, plain, prepare_run_dir, repair_run_dir, restore, rng_state,
                         run_geometry, run_record, save_checkpoint, set_rng_state)
from .config import BAD_INPUT, ConfigError, TrainConfig, parse_train_args, save_config
from .distributed import DistInfo, all_reduce_sum, barrier, broadcast_object, cleanup_distributed, init_distributed
from .engine import EpochResult, NonFiniteLossError, evaluate, train_one_epoch
from .runlog import RunLogger
from .stop import StopRequest


def key_dim_of(model: torch.nn.Module, name: str, model_kwargs: Dict[str, Any]) -> Union[int, List[int]]:
    """The attention key/query dim of a ViT: one int, or one per block when they differ (a converted model)."""
    dims = [layer_key_dim(block.attn) for block in getattr(model, 'blocks', [])]
    if dims and all(dims):
        return dims[0] if len(set(dims)) == 1 else dims
    key_dim = model_kwargs.get('key_dim')
    if key_dim is not None:
        return key_dim
    parts = ModelName.parse(name)
    return parts.key_dim if parts and parts.key_dim else int(getattr(model, 'embed_dim', 0))


def state_dict_sha256(state_dict: Dict[str, torch.Tensor]) -> str:
    """A fingerprint of a model's weights (to check that DDP ranks agree)."""
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        digest.update(key.encode())
        digest.update(state_dict[key].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_on_rank0(fn, dist_info: DistInfo) -> None:
    """Run ``fn`` on rank 0 and raise its ConfigError on every rank (so no rank hangs in a collective)."""
    msg = None
    if dist_info.is_main:
        try:
            fn()
        except ConfigError as e:
            msg = str(e)
    msg = broadcast_object(msg)
    if msg:
        raise ConfigError(msg)


def train(cfg: TrainConfig) -> Dict[str, Any]:
    """Run (or resume) training as configured; returns the final summary (also printed on rank 0)."""
    dist_info = init_distributed(cfg.device)
    stop_request = StopRequest(cfg.output, dist_info.is_main)
    try:
        return _train(cfg, dist_info, stop_request)
    finally:
        stop_request.restore_handlers()
        cleanup_distributed()


def nonfinite_weights(*modules: Optional[torch.nn.Module]) -> list:
    """Names of parameters/buffers that hold NaN or inf, over ``modules`` (first few only; one host read per
    module, before a checkpoint or export)."""
    bad = []
    for module in modules:
        if module is None:
            continue
        named = [(n, t) for n, t in module.state_dict().items() if t.is_floating_point()]
        finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []
        bad += [n for (n, _), ok in zip(named, finite) if not ok]
    return bad[:3]


def _last_good(output: str, dist_info: DistInfo) -> str:
    """Where the last good checkpoint is (for the message of a run stopped by a non-finite loss)."""
    path = os.path.join(output, 'last.pth')
    if not os.path.isfile(path):
        return 'no checkpoint was written'
    try:
        epoch = torch_load(path, mmap=True).get('epoch') if dist_info.is_main else None
    except (WeightsError, AttributeError):
        epoch = None
    return f'{path} (epoch {epoch}) is kept as it was' if epoch is not None else f'{path} is kept as it was'


def _set_up_process(cfg: TrainConfig, dist_info: DistInfo) -> None:
    if cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.deterministic:
        os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    random_seed(cfg.seed, dist_info.rank)  # per rank; DDP then broadcasts rank 0's initial weights


def _checkpoint_to_resume(cfg: TrainConfig, dist_info: DistInfo) -> Optional[Dict[str, Any]]:
    """Checks that write nothing: the run directory, then the checkpoint to resume (when resuming), loaded."""
    last_path = os.path.join(cfg.output, 'last.pth')
    resume = cfg.resume or (cfg.auto_resume and bool(broadcast_object(os.path.isfile(last_path))))
    _check_on_rank0(lambda: check_run_dir(cfg.output, resume, cfg.to_dict()), dist_info)
    if not resume:
        return None
    ckpt = load_training_checkpoint(last_path)
    check_same_run(ckpt, cfg.to_dict(), last_path)
    check_geometry(ckpt, run_geometry(cfg, dist_info.world_size), last_path)
    return ckpt


def _open_run_dir(run: Run, ckpt: Optional[Dict[str, Any]], notes: List[str]) -> None:
    """Only now is anything written: the run directory, repaired after a crash when resuming, the config, and the
    run's log (``run.log``)."""
    cfg, dist_info, repaired, stop_request = run.cfg, run.dist_info, [], run.step.stop_request
    if dist_info.is_main:
        repaired = prepare_run_dir(cfg.output)
        if ckpt is not None:
            repaired += repair_run_dir(cfg.output, ckpt, cfg.checkpoint_every)
        save_config(cfg, os.path.join(cfg.output, 'config.yaml'))
    barrier()
    run.log = log = RunLogger(cfg.output, dist_info.is_main, cfg.to_dict(), cfg.log_wandb, cfg.wandb_project,
                              cfg.experiment, ckpt is not None)
    if stop_request.acknowledge():
        log.info(f'removed a stale {stop_request.stop_file} from an earlier invocation')
    if repaired:
        log.info(f'after an interrupted run: removed or rewrote {", ".join(os.path.basename(r) for r in repaired)}')
    if ckpt is not None:
        progress = run.progress
        within = f', after batch {progress.batches_done} of that epoch' if progress.batches_done else ''
        log.info(f'resumed {cfg.output} at epoch {progress.start_epoch}{within} (step {progress.num_updates})')
    for note in notes:
        log.info(note)


def _key_dim(run: Run) -> Union[int, List[int]]:
    """The run's key dim (:func:`key_dim_of`), for its log and summary."""
    return key_dim_of(run.unwrapped, run.cfg.model, run.cfg.model_kwargs)


def _log_start(run: Run) -> None:
    cfg, dist_info, log = run.cfg, run.dist_info, run.log
    if run.step.model_ema is not None and not run.evaluate_ema:
        log.info('the EMA is kept on the cpu (model_ema_force_cpu): as in timm, it is not evaluated during training; '
                 'its weights are saved and exported (evaluate them with eval.py)')
    global_batch, lr = scaled_lr(cfg, dist_info.world_size)
    num_params = sum(p.numel() for p in run.unwrapped.parameters())
    log.info(f'{cfg.model} (key dim {_key_dim(run)}, {num_params / 1e6:.2f}M params) on {dist_info.world_size} x '
             f'{dist_info.device.type}: {len(run.train_loader.dataset)} train / {len(run.val_loader.dataset)} val '
             f'images, global batch {global_batch}, lr {lr:.3g}, {cfg.epochs} epoch{"s" if cfg.epochs != 1 else ""}')
    if cfg.torchcompile:
        log.info(f'torch.compile (backend {cfg.torchcompile}): the first steps of training and of evaluation compile')


def _restore_rng(run: Run, rng_states: Optional[list]) -> None:
    """The resumed RNG streams: the last thing before the loop, so nothing above shifts them."""
    dist_info = run.dist_info
    if rng_states is None:
        return
    if len(rng_states) == dist_info.world_size:
        set_rng_state(rng_states[dist_info.rank])
    else:
        run.log.info(f'warning: checkpoint has RNG states for {len(rng_states)} ranks, running on '
                     f'{dist_info.world_size}: RNG streams are not restored')


def _start(cfg: TrainConfig, dist_info: DistInfo, stop_request: StopRequest) -> Run:
    """The run, at its start or where its checkpoint stopped, its directory written and its log open."""
    _set_up_process(cfg, dist_info)
    ckpt = _checkpoint_to_resume(cfg, dist_info)  # checks that write nothing come first (then model, data, weights)
    last_path = os.path.join(cfg.output, 'last.pth')
    run = assemble(cfg, dist_info, ckpt, last_path, stop_request)
    notes = []
    if ckpt is not None:
        run.progress, notes = restore(ckpt, last_path, run.step, run.skipper, run_geometry(cfg, dist_info.world_size),
                                      run.updates_per_epoch)
    _open_run_dir(run, ckpt, notes)
    rng_states = None if ckpt is None else ckpt['rng']
    del ckpt
    _log_start(run)
    _restore_rng(run, rng_states)
    return run


def _train(cfg: TrainConfig, dist_info: DistInfo, stop_request: StopRequest) -> Dict[str, Any]:
    run = _start(cfg, dist_info, stop_request)
    progress, epochs_run = run.progress, 0
    for epoch in range(progress.start_epoch, cfg.epochs):
        start = time.perf_counter()
        progress.epoch_rng = rng_state()  # what a mid-epoch checkpoint stores (the sampler's order: the epoch's)
        result = _train_epoch(run, epoch)
        record = result.record()
        if result.stopped and progress.batches_done:
            return _stop_inside_epoch(run, epoch, record)
        if not cfg.sched_on_updates:
            run.step.scheduler.step(epoch + 1)
        _evaluate_epoch(run, epoch, record)
        record.update(epoch=epoch, step=progress.num_updates, epoch_time=time.perf_counter() - start)
        _save_epoch(run, epoch, record)
        run.log.log_epoch(record)
        epochs_run += 1
        if _stop_after_epoch(run, epoch, epochs_run, result.stopped):
            return {'stopped_at_epoch': epoch, 'batches_done': 0, 'step': progress.num_updates, 'output': cfg.output}
    run.step.stop_request.acknowledge()  # a stop asked for during the last epoch has nothing left to stop
    return _finish(run)


def _stop_after_epoch(run: Run, epoch: int, epochs_run: int, stopped: bool) -> bool:
    """Whether to leave after ``epoch`` (``stop_after``, or a stop request answered at the epoch's end)."""
    cfg, stop_request = run.cfg, run.step.stop_request
    stop_reason = 'stop_after' if cfg.stop_after and epochs_run >= cfg.stop_after else None
    if stopped or stop_reason:
        stop_reason = stop_reason or stop_request.decided
    if not (stop_reason and epoch + 1 < cfg.epochs):
        return False
    stop_request.acknowledge()
    run.log.info(f'stopping after epoch {epoch} ({stop_reason}); continue with --resume')
    run.log.finish()
    return True


def _train_epoch(run: Run, epoch: int) -> EpochResult:
    """One training pass (the rest of the epoch after a mid-epoch resume); ``run.progress`` advances. A non-finite
    loss becomes the run's one-line error."""
    cfg, progress = run.cfg, run.progress
    run.skipper.skip = progress.batches_done * cfg.batch_size
    if hasattr(run.train_loader.sampler, 'set_epoch'):
        run.train_loader.sampler.set_epoch(epoch)
    try:
        result = train_one_epoch(run.model, run.train_loader, run.step, epoch, progress.num_updates)
    except NonFiniteLossError as e:
        hint = '' if cfg.skip_nonfinite_loss else ' (lower the lr, set clip_grad, or skip such batches with ' \
                                                  'skip_nonfinite_loss: true)'
        raise NonFiniteLossError(f'{e}: training stopped; {_last_good(cfg.output, run.dist_info)}{hint}') from None
    progress.num_updates = result.num_updates
    if result.nonfinite_skipped:
        run.log.info(f'warning: epoch {epoch}: skipped {result.nonfinite_skipped} batch(es) with a non-finite loss '
                     f'(skip_nonfinite_loss)')
    epoch_batches = run.skipper.skip // cfg.batch_size + len(run.train_loader)
    progress.batches_done += result.batches
    if not (result.stopped and progress.batches_done < epoch_batches):
        progress.batches_done = 0  # the epoch is complete
    return result


def _evaluate_epoch(run: Run, epoch: int, record: Dict[str, Any]) -> None:
    """Evaluation (model and EMA) when due, unreadable-image counts, best top-1."""
    cfg, dist_info, step, progress = run.cfg, run.dist_info, run.step, run.progress
    if epoch + 1 == cfg.epochs or (epoch + 1) % max(cfg.eval_every, 1) == 0:
        progress.metrics = metrics = evaluate(run.model, run.val_loader, dist_info, run.val_samples, step.autocast)
        record.update(top1=metrics['top1'], top5=metrics['top5'], val_loss=metrics['loss'],
                      val_samples=metrics['num_samples'])
        if run.evaluate_ema:
            ema = evaluate(step.model_ema.module, run.val_loader, dist_info, run.val_samples, step.autocast)
            record.update(ema_top1=ema['top1'], ema_top5=ema['top5'], ema_val_loss=ema['loss'])
    if cfg.skip_bad_images:
        _count_bad_images(run, record)
    if 'top1' in record and record['top1'] > progress.best_top1:
        progress.best_top1, progress.best_epoch = record['top1'], epoch


def _count_bad_images(run: Run, record: Dict[str, Any]) -> None:
    """skip_bad_images: the unreadable images skipped so far over all ranks, warned about when there are new ones."""
    sets, progress = (run.train_loader.dataset, run.val_loader.dataset), run.progress
    counts = all_reduce_sum(torch.tensor([float(getattr(s, 'skipped', lambda: 0)()) for s in sets],
                                         dtype=torch.float64, device=run.dist_info.device)).tolist()
    if sum(counts) > progress.bad_images:
        run.log.info(f'warning: skipped {int(counts[0])} unreadable train and {int(counts[1])} val image(s) so far '
                     f'(skip_bad_images)')
    progress.bad_images = int(sum(counts))
    if progress.bad_images:
        record['bad_images_skipped'] = progress.bad_images


def _check_weights(run: Run, when: str) -> None:
    """Never checkpoint or export NaN/inf weights (every rank holds the same weights, so all stop together)."""
    ema = run.step.model_ema
    bad = nonfinite_weights(run.unwrapped, ema.module if ema is not None else None)
    if bad:
        raise NonFiniteLossError(f'non-finite weights ({", ".join(bad)}) {when}: not saved; '
                                 f'{_last_good(run.cfg.output, run.dist_info)}')


def _checkpoint(run: Run, epoch: int, rng_all: list, record: Dict[str, Any]) -> Dict[str, Any]:
    """The run's training checkpoint now; ``epoch``: the last finished one."""
    about = run_record(run.cfg, run.dist_info.world_size, run.model_kwargs, run.data_cfg)
    return checkpoint_state(run.unwrapped, run.step, run.progress, epoch, rng_all, record, about)


def _save_epoch(run: Run, epoch: int, record: Dict[str, Any]) -> None:
    """last.pth is the commit point: written first; best/epoch files and the log record are re-derived from it
    by repair_run_dir when a kill falls between these writes."""
    cfg = run.cfg
    _check_weights(run, f'after epoch {epoch}')
    rng_all = gather_rng(rng_state())
    if run.dist_info.is_main:
        state = _checkpoint(run, epoch, rng_all, record)
        save_checkpoint(state, os.path.join(cfg.output, 'last.pth'))
        if run.progress.best_epoch == epoch:
            save_checkpoint(state, os.path.join(cfg.output, 'best.pth'))
        if cfg.checkpoint_every and (epoch + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(state, os.path.join(cfg.output, f'epoch_{epoch:04d}.pth'))


def _stop_inside_epoch(run: Run, epoch: int, record: Dict[str, Any]) -> Dict[str, Any]:
    """Checkpoint a stop inside ``epoch`` (its start RNG states and those at the stop) and leave."""
    cfg, stop_request, progress = run.cfg, run.step.stop_request, run.progress
    _check_weights(run, f'at the stop inside epoch {epoch}')
    rng_at_start, rng_at_stop = gather_rng(progress.epoch_rng), gather_rng(rng_state())
    if run.dist_info.is_main:
        state = _checkpoint(run, epoch - 1, rng_at_start, record)
        save_checkpoint({**state, 'rng_at_stop': rng_at_stop, 'sample_order': SAMPLE_ORDER},
                        os.path.join(cfg.output, 'last.pth'))
    barrier()
    stop_request.acknowledge()
    run.log.info(f'stop requested ({stop_request.decided}): saved {cfg.output}/last.pth inside epoch {epoch} after '
                 f'batch {progress.batches_done} (step {progress.num_updates}); continue with --resume')
    run.log.finish()
    return {'stopped_at_epoch': epoch, 'batches_done': progress.batches_done, 'step': progress.num_updates,
            'output': cfg.output}


def _finish(run: Run) -> Dict[str, Any]:
    """Export the final weights (and EMA) as safetensors and print the summary."""
    _check_weights(run, 'at the end of training')
    cfg, model, ema, dist_info, progress = run.cfg, run.unwrapped, run.step.model_ema, run.dist_info, run.progress
    summary = {'model': cfg.model, 'key_dim': _key_dim(run), 'params': sum(p.numel() for p in model.parameters()),
               'top1': progress.metrics.get('top1'), 'top5': progress.metrics.get('top5'),
               'best_top1': progress.best_top1, 'best_epoch': progress.best_epoch, 'output': cfg.output,
               'rank': dist_info.rank, 'weights_sha256': state_dict_sha256(model.state_dict())}
    if ema is not None:
        summary['ema_sha256'] = state_dict_sha256(ema.module.state_dict())
    if dist_info.is_main:
        extra = {'data_config': plain(run.data_cfg), 'metrics': {k: summary[k] for k in ('top1', 'top5')}}
        export_safetensors(model.state_dict(), os.path.join(cfg.output, 'model.safetensors'), cfg.model,
                           run.model_kwargs, extra)
        if ema is not None:
            export_safetensors(ema.module.state_dict(), os.path.join(cfg.output, 'model_ema.safetensors'),
                               cfg.model, run.model_kwargs, extra)
        run.log.info(format_summary(summary))
    run.log.finish(summary)
    return summary


def format_summary(s: Dict[str, Any]) -> str:
    """A small results table: model, key dim, params, final and best top-1."""
    top1 = 'n/a' if s['top1'] is None else f"{s['top1']:.2f}"
    rows = [('model', 'key dim', 'params', 'top-1', 'best top-1'),
            (s['model'], str(s['key_dim']), f"{s['params'] / 1e6:.2f}M", top1, f"{s['best_top1']:.2f}")]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [' | '.join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, '-+-'.join('-' * w for w in widths))
    return '\n'.join(lines)


def main(argv: Optional[list] = None) -> int:
    """Console entry: ``train.py -c CONFIG [--key value ...]`` (``console.run_command``). Config, data and weights
    errors are one line, exit 2; a run stopped by a non-finite loss or a failed write (a full disk) one line, exit 1;
    SIGINT / SIGTERM outside the training loop one line, exit 130 / 143 (inside it SIGTERM is a stop request: a
    checkpoint, exit 0)."""
    return run_command(lambda: train(parse_train_args(sys.argv[1:] if argv is None else argv)), BAD_INPUT,
                       (NonFiniteLossError, WriteError),
                       after_signal='; the checkpoints written so far are whole: continue with --auto-resume')
