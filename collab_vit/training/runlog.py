"""The run's log on rank 0 (:class:`RunLogger`): one summary line per epoch on stdout, its record in
``<output>/log.jsonl``, and optional wandb that never blocks or ends a run."""
from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any, Dict, Optional

from ..weights_io import append_line, one_line
from .engine import accuracy_text


def _wandb_online() -> bool:
    """True when an API key is set and the wandb server answers within two seconds."""
    if not os.environ.get('WANDB_API_KEY'):
        return False
    try:
        socket.create_connection(('api.wandb.ai', 443), timeout=2).close()
        return True
    except OSError:
        return False


class RunLogger:
    """Writes epoch records to ``<output>/log.jsonl`` and stdout (and wandb when enabled); silent off rank 0."""

    def __init__(self, output: str, enabled: bool, config: Dict[str, Any], use_wandb: bool = False,
                 project: str = 'collab-vit', name: str = '', resume: bool = False) -> None:
        self.enabled = enabled
        self.path = os.path.join(output, 'log.jsonl')
        self.wandb = None
        if enabled and use_wandb:
            self.wandb = self._init_wandb(output, config, project, name or os.path.basename(output), resume)

    @staticmethod
    def _init_wandb(output: str, config: Dict[str, Any], project: str, name: str, resume: bool):
        mode = os.environ.get('WANDB_MODE') or ('online' if _wandb_online() else 'offline')
        try:
            import wandb
            return wandb.init(project=project, name=name, config=config, dir=output, mode=mode,
                              resume='allow' if resume else None, settings=wandb.Settings(init_timeout=30))
        except Exception as e:  # never let logging take a run down
            print(f'warning: wandb disabled ({type(e).__name__}: {one_line(e)})', file=sys.stderr)
            return None

    def info(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def log_epoch(self, record: Dict[str, Any]) -> None:
        """Append one epoch record and print its summary line."""
        if not self.enabled:
            return
        append_line(self.path, json.dumps(record))
        parts = [f"epoch {record['epoch']:>3d}", f"loss {record['train_loss']:.4f}", f"lr {record['lr']:.2e}",
                 f"{record['img_per_s']:.0f} img/s"]
        if 'top1' in record:
            parts += accuracy_text(record).split(' | ')
        if 'ema_top1' in record:
            parts.append(f"ema top-1 {record['ema_top1']:.2f}")
        parts.append(f"{record['epoch_time']:.1f}s")
        print(' | '.join(parts), flush=True)
        if self.wandb is not None:
            try:
                self.wandb.log(record, step=record['epoch'])
            except Exception:
                pass

    def finish(self, summary: Optional[Dict[str, Any]] = None) -> None:
        if self.wandb is not None:
            try:
                if summary:
                    self.wandb.summary.update(summary)
                self.wandb.finish()
            except Exception:
                pass
