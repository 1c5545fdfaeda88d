"""The scripts in slurm/ submitted with sbatch to a real one-node Slurm cluster on this machine (CPU, gloo).

The cluster comes from ``tests/slurm/cluster.sh`` (Debian's slurm-wlm and munge, installed by scripts/test.sh when
the tests run as root). Tests skip, saying why, only where Slurm is not installed; a cluster that is installed but
does not start fails them.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
import yaml
from safetensors.torch import load_file

from collab_vit.training.checkpoint import load_checkpoint
from collab_vit.weights_io import read_weights
from collab_vit.training.config import build_config
from collab_vit.training.eval_cli import parse_args as evaluate_args, run as evaluate_run
from collab_vit.training.trainer import train

from test_calibration_cli import exported
from tinyrun import ROOT, make_image_folder, tiny_data, tiny_overrides  # noqa: F401  (tiny_data is a fixture)

CLUSTER = os.path.join(ROOT, 'tests', 'slurm', 'cluster.sh')
SLURM_DIR = os.environ.get('SLURM_TEST_DIR', '/tmp/collab-vit-slurm')
NOT_INSTALLED = ('Slurm is not installed on this machine (Debian packages slurm-wlm and munge; '
                 '`bash tests/slurm/cluster.sh install` as root installs them)')
# RNG consumers on (RandAugment, erasing, mixup/cutmix, drop path, EMA): a resumed run must still match exactly
RECIPE = dict(aa='rand-m9-mstd0.5-inc1', reprob=0.25, mixup=0.8, cutmix=1.0, drop_path=0.1, model_ema=True,
              model_ema_decay=0.9, deterministic=True, seed=5, eval_every=1000, progress=False)


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
    """Environment for sbatch/squeue/scontrol talking to the local test cluster (started here if needed)."""
    if not (shutil.which('sbatch') and shutil.which('slurmctld') and shutil.which('munged')):
        pytest.skip(NOT_INSTALLED)
    started = subprocess.run(['bash', CLUSTER, 'start'], capture_output=True, text=True, timeout=180)
    assert started.returncode == 0, f'the local Slurm cluster did not start:\n{started.stdout}\n{started.stderr}'
    env = {**os.environ, 'SLURM_CONF': os.path.join(SLURM_DIR, 'slurm.conf'), 'REPO_DIR': ROOT,
           'VENV': sys.prefix, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}
    env.pop('SLURM_JOB_ID', None)
    return env


def tiny_config(tmp_path: Path, data_dir: str, name: str, **extra) -> str:
    """A YAML config for a tiny model on the tiny ImageFolder (train_job sets the output directory)."""
    cfg = tiny_overrides(data_dir, '', **extra)
    del cfg['output']
    path = tmp_path / f'{name}.yaml'
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def sbatch(env: dict, script: str, *args: str, options: tuple = (), extra_env: dict | None = None) -> str:
    """Submit a script from slurm/ (from the checkout, as users do); returns the job id."""
    out = subprocess.run(['sbatch', '--parsable', *options, os.path.join('slurm', script), *args], cwd=ROOT,
                         env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(';')[0]


def job_info(env: dict, job_id: str) -> dict:
    text = subprocess.run(['scontrol', 'show', 'job', job_id], env=env, capture_output=True, text=True).stdout
    return dict(field.split('=', 1) for field in text.split() if '=' in field)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f'timed out after {timeout:.0f} s waiting for {what}'
        time.sleep(0.5)


def wait_for_end(env: dict, job_id: str, timeout: float = 300) -> dict:
    """Wait until the job (and any requeue of it) has ended; returns its ``scontrol show job`` fields."""
    wait_until(lambda: job_info(env, job_id).get('JobState') in ('COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT',
                                                                   'NODE_FAIL', 'OUT_OF_MEMORY'),
               timeout, f'job {job_id} to end')
    return job_info(env, job_id)


def lines(path: Path) -> list:
    return path.read_text().splitlines() if path.exists() else []


def read_all_logs(exp_dir: Path) -> str:
    return ''.join(p.read_text() for p in sorted((exp_dir / 'logs').glob('*node*.log')))


@pytest.fixture(scope='module')
def trained(slurm, tiny_data, tmp_path_factory):
    """One finished train.sbatch job: 2 processes on the node (DDP over gloo), 2 epochs."""
    tmp = tmp_path_factory.mktemp('slurm_train')
    config = tiny_config(tmp, tiny_data, 'tiny_ddp', epochs=2, progress=False)
    job = sbatch(slurm, 'train.sbatch', config, options=(f'--output={tmp}/%x-%j.out',),
                 extra_env={'RUNS_DIR': str(tmp / 'runs'), 'NPROC_PER_NODE': '2'})
    info = wait_for_end(slurm, job)
    return job, info, tmp / 'runs' / 'tiny_ddp', tmp


def test_train_job_trains_and_checkpoints(trained):
    job, info, exp_dir, tmp = trained
    assert info['JobState'] == 'COMPLETED', (tmp / f'collab-vit-train-{job}.out').read_text()
    ckpt = load_checkpoint(exp_dir / 'last.pth')
    assert ckpt['epoch'] == 1 and len(ckpt['rng']) == 2  # both epochs, two ranks
    assert ckpt['step'] == 6  # 24 images / (2 ranks x batch 4) = 3 updates per epoch
    assert (exp_dir / 'model.safetensors').exists()
    jobs_log = (exp_dir / 'logs' / 'jobs.log').read_text()
    assert f'job {job} (restart 0): tiny_ddp on 1 node(s) x 2 process(es)' in jobs_log and 'finished' in jobs_log
    assert 'on 2 x cpu' in read_all_logs(exp_dir)


def test_finished_experiment_is_not_rerun(slurm, trained):
    _, _, exp_dir, tmp = trained
    before = (exp_dir / 'last.pth').stat().st_mtime_ns
    config = str(tmp / 'tiny_ddp.yaml')
    job = sbatch(slurm, 'train.sbatch', config, options=(f'--output={tmp}/again-%j.out',),
                 extra_env={'RUNS_DIR': str(exp_dir.parent)})
    assert wait_for_end(slurm, job)['JobState'] == 'COMPLETED'
    assert 'already finished' in (tmp / f'again-{job}.out').read_text()
    assert (exp_dir / 'last.pth').stat().st_mtime_ns == before


def test_eval_job_reproduces_the_training_accuracy(slurm, trained, tiny_data):
    job, _, exp_dir, tmp = trained
    weights = exp_dir / 'model.safetensors'
    eval_job = sbatch(slurm, 'eval.sbatch', str(weights), '--data-dir', tiny_data, '--cpu-threads', '1',
                      options=(f'--output={tmp}/%x-%j.out',))
    assert wait_for_end(slurm, eval_job)['JobState'] == 'COMPLETED', (tmp / f'collab-vit-eval-{eval_job}.out').read_text()
    results = json.loads((exp_dir / f'eval-model-{eval_job}.json').read_text())
    _, meta = read_weights(str(weights))
    assert results['top1'] == pytest.approx(meta['metrics']['top1'])


def test_stopped_and_requeued_job_resumes_to_the_uninterrupted_result(slurm, tiny_data, tmp_path):
    """Time-limit warning (SIGUSR1 to the batch shell), then a requeue (SIGTERM, as preemption does): the job
    checkpoints mid-run each time, comes back, resumes from last.pth and ends bit-identical to an uninterrupted run."""
    epochs = 150
    config = tiny_config(tmp_path, tiny_data, 'tiny_long', epochs=epochs, **RECIPE)
    exp_dir = tmp_path / 'runs' / 'tiny_long'
    job = sbatch(slurm, 'train.sbatch', config, options=(f'--output={tmp_path}/%x-%j.out',),
                 extra_env={'RUNS_DIR': str(tmp_path / 'runs')})
    wait_until(lambda: len(lines(exp_dir / 'log.jsonl')) >= 2, 240, 'the first epochs')
    subprocess.run(['scancel', '--batch', '--signal=USR1', job], env=slurm, check=True)  # what --signal=B:USR1 does
    wait_until(lambda: 'resumed' in read_all_logs(exp_dir), 240, 'the requeued job to resume')
    done = len(lines(exp_dir / 'log.jsonl'))
    wait_until(lambda: len(lines(exp_dir / 'log.jsonl')) >= done + 2, 240, 'the resumed job to train')
    subprocess.run(['scontrol', 'requeue', job], env=slurm, check=True)  # preemption: SIGTERM, then requeue
    info = wait_for_end(slurm, job, timeout=600)
    batch_log = (tmp_path / f'collab-vit-train-{job}.out').read_text()
    assert info['JobState'] == 'COMPLETED' and info['Restarts'] == '2', batch_log
    logs = read_all_logs(exp_dir)
    assert '(STOP)' in logs and '(SIGTERM)' in logs, logs[-3000:]  # mid-epoch or at an epoch's last update
    assert logs.count('resumed') == 2 and 'SIGUSR1: asked the trainer to checkpoint' in batch_log
    assert batch_log.count('--resume ->') == 2 and 'checkpoint saved, requeueing' in batch_log
    epochs_logged = [json.loads(x)['epoch'] for x in lines(exp_dir / 'log.jsonl')]
    assert sorted(set(epochs_logged)) == list(range(epochs))
    assert not (exp_dir / 'STOP').exists()

    reference = train(build_config(config, {'output': str(tmp_path / 'reference'), 'cpu_threads': 1}))
    a, b = load_checkpoint(exp_dir / 'last.pth'), load_checkpoint(tmp_path / 'reference' / 'last.pth')
    assert a['step'] == b['step'] == epochs * 6
    for part in ('model', 'model_ema'):
        for k in b[part]:
            assert torch.equal(a[part][k], b[part][k]), f'{part}.{k} differs from the uninterrupted run'
    assert reference['top1'] == pytest.approx(json.loads(lines(exp_dir / 'log.jsonl')[-1])['top1'])


def test_sweep_array_trains_every_config(slurm, tiny_data, tmp_path):
    configs = [tiny_config(tmp_path, tiny_data, name, epochs=1, model_kwargs=dict(kwargs))
               for name, kwargs in (('sweep_k24', {'key_dim': 24, 'patch_size': 8, 'depth': 1, 'embed_dim': 48,
                                                   'num_heads': 3}),
                                    ('sweep_k12', {'key_dim': 12, 'patch_size': 8, 'depth': 1, 'embed_dim': 48,
                                                   'num_heads': 3}))]
    job = sbatch(slurm, 'sweep.sbatch', options=('--array=0-1', f'--output={tmp_path}/%x-%A_%a.out'),
                 extra_env={'RUNS_DIR': str(tmp_path / 'runs'), 'SWEEP_CONFIGS': ' '.join(configs)})
    for task in (0, 1):
        assert wait_for_end(slurm, f'{job}_{task}')['JobState'] == 'COMPLETED'
    for name, key_dim in (('sweep_k24', 24), ('sweep_k12', 12)):
        _, meta = read_weights(str(tmp_path / 'runs' / name / 'model.safetensors'))
        assert meta['model_kwargs']['key_dim'] == key_dim


def test_convert_job_writes_a_collaborative_checkpoint(slurm, tmp_path):
    source = tmp_path / 'deit_tiny.pth'
    torch.save(timm.create_model('deit_tiny_patch16_224').state_dict(), source)
    out = tmp_path / 'converted' / 'deit_tiny_k96.safetensors'
    job = sbatch(slurm, 'convert.sbatch', '--model', 'deit_tiny_patch16_224', '--checkpoint', str(source),
                 '--key-dim', '96', '--out', str(out), options=(f'--output={tmp_path}/%x-%j.out',))
    assert wait_for_end(slurm, job)['JobState'] == 'COMPLETED', (tmp_path / f'collab-vit-convert-{job}.out').read_text()
    _, meta = read_weights(str(out))
    assert meta['model_name'] == 'collab_deit_tiny_patch16_224' and (out.parent / 'logs').is_dir()


# Imported first by the job's Python (PYTHONPATH): the second layer's refinement of the first run waits (until the
# job's signal stops it), so that Slurm's warning arrives after exactly one committed layer
PAUSE_SECOND_LAYER = """
import os, time
from collab_vit.conversion.calibration import blockwise
real, started = blockwise.refine_layer, []

def pausing(*args, **kwargs):
    if started and int(os.environ.get('SLURM_RESTART_COUNT', '0')) == 0:
        open(os.environ['PAUSED_FILE'], 'w').close()
        time.sleep(300)
    started.append(1)
    return real(*args, **kwargs)

blockwise.refine_layer = pausing
"""


def test_convert_job_stopped_by_the_warning_signal_requeues_and_resumes(slurm, tmp_path):
    """slurm/convert.sbatch, calibrated: Slurm's time-limit warning (USR1) after the first refined layer stops the
    conversion, the job requeues itself and the same command resumes from <out>.partial, ending with the weights of an
    uninterrupted run, bit for bit (one CPU thread each)."""
    data = make_image_folder(tmp_path / 'data', classes=4, train_per_class=40, val_per_class=1, size=12)
    args = ['--checkpoint', exported(tmp_path), '--key-dim', '6', '--calibration-data-dir', str(data),
            '--calibration-images', '96']
    whole = subprocess.run([sys.executable, '-m', 'collab_vit.cli', 'convert', *args, '--out',
                            str(tmp_path / 'whole.safetensors')], env=slurm, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    (tmp_path / 'hook').mkdir()
    (tmp_path / 'hook' / 'sitecustomize.py').write_text(PAUSE_SECOND_LAYER)
    out, paused = tmp_path / 'converted' / 'k6.safetensors', tmp_path / 'paused'
    job = sbatch(slurm, 'convert.sbatch', *args, '--out', str(out), options=(f'--output={tmp_path}/%x-%j.out',),
                 extra_env={'PYTHONPATH': str(tmp_path / 'hook'), 'PAUSED_FILE': str(paused)})
    wait_until(paused.exists, 180, 'the second layer of the first run')
    assert list(json.loads((tmp_path / 'converted' / 'k6.safetensors.partial' / 'state.json').read_text())['layers']) \
        == ['0']
    subprocess.run(['scancel', '--batch', '--signal=USR1', job], env=slurm, check=True)
    info = wait_for_end(slurm, job)
    log = (tmp_path / f'collab-vit-convert-{job}.out').read_text()
    assert info['JobState'] == 'COMPLETED' and info['Restarts'] == '1', log
    assert 'SIGUSR1, stopping the conversion' in log and 'requeueing; the same command resumes' in log
    converted = ''.join(p.read_text() for p in (out.parent / 'logs').glob('*-convert.log'))
    assert 'resuming: 1 of 2 layers refined by a stopped run of this command' in converted
    assert not (tmp_path / 'converted' / 'k6.safetensors.partial').exists()
    expected, got = load_file(str(tmp_path / 'whole.safetensors')), load_file(str(out))
    assert expected.keys() == got.keys() and all(expected[k].equal(got[k]) for k in expected)


# A standard DeiT far below DeiT-B's size, with its own class count: the source of the post-hoc array at tiny size
POSTHOC_SOURCE = dict(img_size=32, patch_size=8, depth=1, embed_dim=48, num_heads=3, num_classes=3)
POSTHOC_FINETUNE = ('--epochs', '1', '--batch-size', '4', '--lr-base-batch', '4', '--num-workers', '0', '--pin-memory',
                    'false', '--persistent-workers', 'false', '--repeated-aug', '0', '--progress', 'false',
                    '--cpu-threads', '1', '--device', 'cpu')


def test_posthoc_array_converts_evaluates_finetunes_and_continues(slurm, tiny_data, tmp_path):
    """slurm/posthoc.sbatch at tiny size, two key dims: conversion alone first (as on a CPU partition; one task gets
    the time-limit warning mid-conversion and requeues), then the whole array, which finds the conversions done;
    every cell converted, evaluated, fine-tuned and evaluated again, the source evaluated; a resubmission redoes
    nothing. (The three tasks share the two CPUs: --oversubscribe.)"""
    torch.manual_seed(0)
    torch.save(timm.create_model('deit_tiny_patch16_224', **POSTHOC_SOURCE).state_dict(), tmp_path / 'source.pth')
    kwargs = [f'{k}={v}' for k, v in POSTHOC_SOURCE.items()]
    root = tmp_path / 'runs' / 'posthoc'
    env = {'RUNS_DIR': str(tmp_path / 'runs'), 'EXPERIMENT': 'posthoc', 'POSTHOC_DATA_DIR': tiny_data,
           'POSTHOC_MODEL': 'deit_tiny_patch16_224', 'POSTHOC_CHECKPOINT': str(tmp_path / 'source.pth'),
           'POSTHOC_MODEL_KWARGS': ' '.join(kwargs), 'POSTHOC_KEY_DIMS': '12 8',
           'NPROC_PER_NODE': '1', 'POSTHOC_EVAL_ARGS': '--cpu-threads 1 --workers 0 --batch-size 12'}
    cells = {'tucker_k12': 12, 'tucker_k8': 8}  # tasks 0 and 1; task 2: the source

    def submit(name: str, warn_task: int = -1, **extra) -> list:
        job = sbatch(slurm, 'posthoc.sbatch', *POSTHOC_FINETUNE, extra_env={**env, **extra},
                     options=('--array=0-2', '--oversubscribe', f'--output={tmp_path}/{name}-%a.out'))
        if warn_task >= 0:  # Slurm's time-limit warning (what --signal=B:USR1 does) while the conversion runs
            out = tmp_path / f'{name}-{warn_task}.out'
            wait_until(lambda: 'converting' in ''.join(lines(out)), 120, 'the conversion to start')
            subprocess.run(['scancel', '--batch', '--signal=USR1', f'{job}_{warn_task}'], env=slurm, check=True)
        restarts = []
        for task in range(3):
            info = wait_for_end(slurm, f'{job}_{task}')
            assert info['JobState'] == 'COMPLETED', (tmp_path / f'{name}-{task}.out').read_text()
            restarts.append(int(info['Restarts']))
        assert restarts == [int(task == warn_task) for task in range(3)]
        return [(tmp_path / f'{name}-{task}.out').read_text() for task in range(3)]

    logs = submit('convert', warn_task=1, POSTHOC_CONVERT_ONLY='1')
    assert 'SIGUSR1, stopping the conversion' in logs[1] and 'requeueing; the same command resumes' in logs[1]
    assert logs[1].count('tucker_k8: converting') == 2  # requeued, converted again
    for task, (cell, key_dim) in enumerate(cells.items()):
        conversion = json.loads((root / cell / 'converted.json').read_text())
        assert conversion['method'] == 'tucker' and conversion['model_kwargs'] == {**POSTHOC_SOURCE, 'key_dim': [key_dim]}
        assert f'{cell}: converted (POSTHOC_CONVERT_ONLY=1' in logs[task]
        assert not (root / cell / 'eval_converted.json').exists() and not (root / cell / 'finetune').exists()
    assert 'source: nothing to convert' in logs[2] and not (root / 'source' / 'eval.json').exists()
    converted_at = {cell: (root / cell / 'converted.safetensors').stat().st_mtime_ns for cell in cells}

    logs = submit('all')
    for task, (cell, key_dim) in enumerate(cells.items()):
        assert f'{cell}: converted already' in logs[task] and f'{cell}: done' in logs[task]
        assert (root / cell / 'converted.safetensors').stat().st_mtime_ns == converted_at[cell]
        result = json.loads((root / cell / 'result.json').read_text())
        assert (result['method'], result['key_dim'], result['finetune_epochs']) == ('tucker', key_dim, 1)
        before = json.loads((root / cell / 'eval_converted.json').read_text())
        after = json.loads((root / cell / 'eval_finetuned.json').read_text())
        assert before['checkpoint'] == str(root / cell / 'converted.safetensors')
        assert after['checkpoint'] == str(root / cell / 'finetune' / 'model.safetensors')
        for step, evaluated in (('converted', before), ('finetuned', after)):
            assert evaluated['model'] == 'collab_deit_tiny_patch16_224' and evaluated['num_samples'] == 12
            assert 0 <= evaluated['top1'] <= 100 and result[step]['top1'] == evaluated['top1']
        # fine-tuned from the converted weights with the fine-tune recipe; eval.py agrees with the trainer's last epoch
        cfg = yaml.safe_load((root / cell / 'finetune' / 'config.yaml').read_text())
        assert cfg['checkpoint'] == str(root / cell / 'converted.safetensors') and cfg['lr'] == 1e-5
        _, meta = read_weights(str(root / cell / 'finetune' / 'model.safetensors'))
        assert meta['model_name'] == 'collab_deit_tiny_patch16_224' and meta['model_kwargs']['key_dim'] == key_dim
        assert after['top1'] == pytest.approx(meta['metrics']['top1'])
    reference = evaluate_run(evaluate_args(['--model', 'deit_tiny_patch16_224', '--checkpoint',
                                            str(tmp_path / 'source.pth'), '--data-dir', tiny_data, '--workers', '0',
                                            '--cpu-threads', '1', '--model-kwargs', *kwargs]))
    assert json.loads((root / 'source' / 'eval.json').read_text())['top1'] == pytest.approx(reference['top1'])
    summary = json.loads((root / 'summary.json').read_text())
    assert [(r['method'], r['key_dim']) for r in summary['cells']] == [('tucker', 12), ('tucker', 8)]
    assert summary['source']['top1'] == pytest.approx(reference['top1'])
    assert len((root / 'summary.md').read_text().splitlines()) == 2 + 1 + 2  # header, source, cells

    steps = {p: p.stat().st_mtime_ns for p in root.rglob('*') if p.suffix in ('.json', '.safetensors', '.pth')
             and p.name not in ('result.json', 'summary.json')}
    logs = submit('again')
    for task, cell in enumerate(cells):
        for step in ('converted', 'evaluated after conversion', 'fine-tuned', 'evaluated after fine-tuning'):
            assert f'{cell}: {step} already' in logs[task]
    assert 'source: evaluated already' in logs[2]
    assert {p: p.stat().st_mtime_ns for p in steps} == steps


def test_posthoc_without_data_fails_with_a_clear_message(slurm, tmp_path):
    job = sbatch(slurm, 'posthoc.sbatch', options=('--array=0', f'--output={tmp_path}/%x-%A_%a.out'),
                 extra_env={'RUNS_DIR': str(tmp_path / 'runs'), 'POSTHOC_DATA_DIR': str(tmp_path / 'imagenet')})
    assert wait_for_end(slurm, f'{job}_0')['JobState'] == 'FAILED'
    out = (tmp_path / f'collab-vit-posthoc-{job}_0.out').read_text()
    missing = tmp_path / 'imagenet'
    assert out.strip() == f"error: POSTHOC_DATA_DIR is not a directory: '{missing}' (set it to the ImageNet root)"
    assert not (tmp_path / 'runs').exists()


def test_bad_config_fails_the_job_with_a_clear_message(slurm, tmp_path):
    job = sbatch(slurm, 'train.sbatch', 'configs/no_such_config.yaml', options=(f'--output={tmp_path}/%x-%j.out',),
                 extra_env={'RUNS_DIR': str(tmp_path / 'runs')})
    assert wait_for_end(slurm, job)['JobState'] == 'FAILED'
    assert 'error: config not found: configs/no_such_config.yaml' in (tmp_path / f'collab-vit-train-{job}.out').read_text()
    assert not (tmp_path / 'runs').exists()


def test_two_torchrun_agents_meet_through_the_launch_script(tiny_data, tmp_path):
    """The multi-node path without Slurm: slurm/launch.sh twice on localhost, --nnodes=2, c10d rendezvous."""
    config = tiny_config(tmp_path, tiny_data, 'two_nodes', epochs=1)
    env = {**os.environ, 'NNODES': '2', 'NPROC_PER_NODE': '1', 'RDZV_ENDPOINT': '127.0.0.1:29611',
           'RDZV_ID': f'test-{os.getpid()}', 'PYTHON': sys.executable, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': ROOT}
    agents = [subprocess.Popen(['bash', 'slurm/launch.sh', 'train.py', '-c', config, '--output',
                                str(tmp_path / 'run')], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], '\n'.join(o[-2000:] for o in outputs)
    assert 'on 2 x cpu' in ''.join(outputs)  # one world of two ranks, one on each agent
    ckpt = load_checkpoint(tmp_path / 'run' / 'last.pth')
    assert len(ckpt['rng']) == 2 and ckpt['step'] == 3


def test_shell_scripts_pass_shellcheck():
    if not shutil.which('shellcheck'):
        pytest.skip('shellcheck is not installed (Debian package shellcheck; `bash tests/slurm/cluster.sh install`)')
    scripts = [str(p.relative_to(ROOT)) for p in sorted(Path(ROOT, 'slurm').iterdir())] + [
        'tests/slurm/cluster.sh', 'scripts/test.sh', 'scripts/quickstart.sh', 'scripts/venv.sh', '.ci/run']
    out = subprocess.run(['shellcheck', '-x', *scripts], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
