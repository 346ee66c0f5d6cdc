"""Experiment tracking: Weights & Biases (`logging.wandb`) and TensorBoard (`logging.tensorboard`),
fed by one process, the orchestrator. The metrics JSONL files stay the source of truth; a tracker
only mirrors them.

What is logged, with `step` (the RL step of the record) as the x axis:

- `orchestrator/<key>`: each record the orchestrator writes to `orchestrator_metrics.jsonl`, as
  it is written;
- `policy/<key>` and `critic/<key>`: each new line of `policy_metrics.jsonl` and
  `critic_metrics.jsonl` (the trainers write them in the same `logging.dir`), read as the lines
  arrive (after every orchestrator record and once more at the end). The critic's value
  pretraining lines have negative steps.

Keys are the JSONL keys; nested dicts become `a/b` (`orchestrator/time/total`), booleans 0/1;
strings, lists and nulls are not logged. The resolved config is logged once when the tracker
starts (W&B: the run's config; TensorBoard: a text summary `config`).

Resume: the W&B run id is kept in `logging.dir/wandb_run_id`; a run that resumes from a
checkpoint (`checkpoint.resume`, same `logging.dir`) continues that run (`wandb.init(id=...,
resume="allow")`). W&B has no resume offline: a resumed offline run keeps the run id, and wandb
writes the session to a new directory `logging.dir/wandb/offline-run-<time>-<id>` beside the
first. TensorBoard appends a new event file to `logging.dir/tensorboard`. How far each trainer's
JSONL file was read is kept in `logging.dir/tracking_offsets.json`, so a resumed run does not log
the lines of the earlier one twice.

A tracker that raises (W&B online with no network, a full disk) is reported once as a warning
naming its key and the error, and is off for the rest of the run; training goes on. A tracker
whose package is missing is an error at start, naming the key.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from megatron_rl.config import ResolvedConfig, WandbConfig

log = logging.getLogger(__name__)

ROLE_FILES = {"policy": "policy_metrics.jsonl", "critic": "critic_metrics.jsonl"}
RUN_ID_FILE = "wandb_run_id"
OFFSETS_FILE = "tracking_offsets.json"


class TrackingError(RuntimeError):
    """A tracker asked for in the config cannot start (its package is missing)."""


def flatten(record: dict, prefix: str = "", _top: bool = True) -> dict[str, float]:
    """The numbers of `record` under `prefix`, nested dicts joined with `/`; the top-level `step`
    (the x axis), strings, lists and None are left out, booleans become 0.0/1.0."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/", _top=False))
        elif _top and key == "step":
            continue
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


def _missing(key: str, package: str, exc: ImportError) -> TrackingError:
    return TrackingError(f"{key} needs the {package} package: pip install megatron_rl[tracking] ({exc})")


class WandbBackend:
    key = "logging.wandb"

    def __init__(self, config: WandbConfig, log_dir: Path, run_config: dict | None, resume: bool):
        try:
            import wandb
        except ImportError as exc:
            raise _missing(self.key, "wandb", exc) from exc
        id_path = log_dir / RUN_ID_FILE
        run_id = id_path.read_text().strip() if resume and id_path.is_file() else ""
        kwargs = {"id": run_id, "resume": "allow"} if run_id else {}
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name,
            tags=list(config.tags) or None,
            mode=config.mode,
            dir=str(log_dir),
            config=run_config,
            # The orchestrator's stdout stays its own (its log file and progress bar).
            settings=wandb.Settings(console="off"),
            **kwargs,
        )
        id_path.write_text(self.run.id)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({"step": step, **metrics})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class TensorBoardBackend:
    key = "logging.tensorboard"

    def __init__(self, log_dir: Path, run_config: dict | None):
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing(self.key, "tensorboard", exc) from exc
        self.dir = log_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.dir))
        if run_config is not None:
            text = json.dumps(run_config, indent=2)
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Follower:
    """New complete lines of one JSONL file, from a remembered byte offset."""

    def __init__(self, path: Path, offset: int = 0):
        self.path, self.offset = path, offset
        self.last_step: int | None = None  # the step of the newest line read (or read before)
        if offset and path.is_file():
            with open(path, "rb") as f:
                f.seek(max(0, offset - 65536))
                lines = [line for line in f.read(offset - f.tell()).splitlines() if line.strip()]
            try:
                step = json.loads(lines[-1]).get("step") if lines else None
            except (ValueError, AttributeError):
                step = None
            self.last_step = step if isinstance(step, int) else None

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        if self.path.stat().st_size < self.offset:  # replaced or truncated: start over
            self.offset = 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n")  # a line still being written waits for the next read
        if end < 0:
            return []
        self.offset += end + 1
        records = []
        for line in data[: end + 1].splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                log.warning("tracking: skipped a line of %s that is not JSON: %.200r", self.path, line)
                continue
            if isinstance(record, dict):
                records.append(record)
                if isinstance(record.get("step"), int):
                    self.last_step = record["step"]
        return records


class Tracker:
    """Fans metrics records out to the configured trackers (see the module docstring).

    `log(record)` logs one orchestrator record, then the trainers' new lines (`poll()`);
    `close(final_step)` waits (up to `timeout_s`) for each trainer file that exists to reach
    `final_step`, logs the last lines and closes the trackers."""

    def __init__(self, log_dir: str | Path, *, wandb: WandbConfig | None = None, tensorboard: bool = False,
                 run_config: dict | None = None, resume: bool = True, roles: dict[str, str] = ROLE_FILES):  # fmt: skip
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.backends: list = []
        self.failures: list[str] = []
        # The packages are checked first: a missing one is an error before any tracker starts.
        if wandb is not None and wandb.mode != "disabled":
            self._start(lambda: WandbBackend(wandb, self.dir, run_config, resume), WandbBackend.key)
        if tensorboard:
            self._start(lambda: TensorBoardBackend(self.dir, run_config), TensorBoardBackend.key)
        offsets = self._load_offsets()
        self.followers = {
            role: _Follower(self.dir / name, offsets.get(name, 0)) for role, name in roles.items()
        }

    @classmethod
    def from_config(cls, resolved: ResolvedConfig) -> Tracker | None:
        """The tracker of `resolved.logging`, or None when no tracker is on."""
        cfg = resolved.logging
        wandb = cfg.wandb if cfg.wandb is not None and cfg.wandb.mode != "disabled" else None
        if wandb is None and not cfg.tensorboard:
            return None
        return cls(cfg.dir, wandb=wandb, tensorboard=cfg.tensorboard, run_config=json.loads(resolved.to_json()),
                   resume=resolved.checkpoint.resume)  # fmt: skip

    @property
    def active(self) -> bool:
        return bool(self.backends)

    @property
    def wandb_run_id(self) -> str | None:
        return next((b.run_id for b in self.backends if isinstance(b, WandbBackend)), None)

    def _start(self, make, key: str) -> None:
        try:
            self.backends.append(make())
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001  (any failure of a tracker: report it, train on)
            self._report(key, exc)

    def _report(self, key: str, exc: BaseException) -> None:
        self.failures.append(key)
        log.warning("%s failed (%s: %s): it is off for the rest of the run; the metrics JSONL files in %s "
                    "keep every metric", key, type(exc).__name__, exc, self.dir)  # fmt: skip

    def _call(self, method: str, *args) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception as exc:  # noqa: BLE001
                self.backends.remove(backend)
                self._report(backend.key, exc)
                if method != "close":
                    try:
                        backend.close()
                    except Exception:  # noqa: BLE001  (already reported)
                        pass

    def _emit(self, prefix: str, record: dict) -> None:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            return
        metrics = flatten(record, f"{prefix}/")
        if metrics:
            self._call("log", step, metrics)

    def log(self, record: dict) -> None:
        """One orchestrator record (as written to `orchestrator_metrics.jsonl`), then the
        trainers' lines that arrived since the last call."""
        self._emit("orchestrator", record)
        self.poll()

    def poll(self) -> None:
        moved = False
        for role, follower in self.followers.items():
            before = follower.offset
            for record in follower.read():
                self._emit(role, record)
            moved |= follower.offset != before
        self._call("flush")
        if moved:
            self._save_offsets()

    def close(self, final_step: int | None = None, timeout_s: float = 30.0) -> None:
        """Logs the trainers' last lines (waiting up to `timeout_s` for each existing file to
        reach `final_step`, when given) and closes the trackers."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            behind = [f for f in self.followers.values() if final_step is not None and f.path.is_file()
                      and (f.last_step is None or f.last_step < final_step)]  # fmt: skip
            if not behind or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        self._call("close")
        self.backends.clear()

    def _load_offsets(self) -> dict[str, int]:
        path = self.dir / OFFSETS_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return (
            {k: v for k, v in data.items() if isinstance(v, int) and v >= 0} if isinstance(data, dict) else {}
        )

    def _save_offsets(self) -> None:
        path = self.dir / OFFSETS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({f.path.name: f.offset for f in self.followers.values()}))
        tmp.replace(path)
