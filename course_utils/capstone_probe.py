"""The harness that lets lesson 11's check follow the learner's training script: it starts the ranks as torchrun
would, each under a probe that records what the rank did, and can stop a run at a chosen step as a crash would.

The probe runs inside each rank, before the script: `python -c RANK_COMMAND script args...`. It records
- every optimizer step: the learning rates and weight decays of the groups, the gradients as the step sees
  them (after any clipping), the weights and the optimizer's state before it;
- every training forward of the learner's TinyGPT: its input, the autocast state, torch's random state;
- the training samples each rank read, DistributedSampler's set_epoch calls and the order it handed out;
- every torch.save (which rank, which step, the rank's random states at that moment) and torch.load
  (its weights_only argument, and the step of the checkpoint it read);
- the models wrapped in DistributedDataParallel, the final weights, and whether the process group was
  still up when the script ended;
and writes it all to rank<N>.pt in the run's folder, a file torch.load(weights_only=True) reads. The run's
problems replace course_utils.addition.training_problems(), and with kill_at the rank kills itself
(SIGKILL, no clean-up) right after that optimizer step. Without the probe's environment variable none of
this happens: it is off in the learner's own runs.
"""

import contextlib
import json
import os
import random
import runpy
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from course_utils import rank_server

PROBE_ENV = "COURSE_CAPSTONE_PROBE"
RANK_COMMAND = "from course_utils.capstone_probe import run_rank; run_rank()"
LEARNER_MODULES = ("capstone_data", "capstone_model")


def _file_name(f) -> str | None:
    """The path torch.save or torch.load was given (a path, or an open file's name); None for a buffer in memory."""
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    name = getattr(f, "name", None)
    return name if isinstance(name, str) else None


def _clone(tensors) -> list:
    return [None if t is None else t.detach().clone() for t in tensors]


def _python_state() -> tuple:
    return random.getstate()


def _numpy_state() -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.random.get_state()[1].astype(np.int64))


class Probe:
    """What one rank of the script did (see the module's docstring)."""

    def __init__(self, rank: int, folder: Path, kill_at: int | None):
        self.rank, self.folder, self.kill_at = rank, folder, kill_at
        self.steps: list[dict] = []
        self.after: list[dict] = []  # the random states right after each optimizer step, where a checkpoint saves them
        self.forwards: list[dict] = []
        self.reads: list[int] = []
        self.epochs: list[int] = []
        self.orders: list[dict] = []
        self.saves: list[dict] = []
        self.loads: list[dict] = []
        self.ddp_wraps: list[bool] = []
        self.models: list[torch.nn.Module] = []
        self.real_save, self.real_load = torch.save, torch.load

    # the learner's classes

    def watch_model_class(self, cls) -> None:
        probe, real_init = self, cls.__init__

        def init(model, *args, **kwargs):
            real_init(model, *args, **kwargs)
            probe.models.append(model)
            model.register_forward_pre_hook(probe.record_forward)

        cls.__init__ = init

    def watch_dataset_class(self, cls) -> None:
        probe, real_getitem = self, cls.__getitem__

        def getitem(dataset, index):
            probe.reads.append(int(index))
            return real_getitem(dataset, index)

        cls.__getitem__ = getitem

    def record_forward(self, model, args) -> None:
        if not (model.training and torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)):
            return
        self.forwards.append({"step": len(self.steps), "model": self.models.index(model), "tokens": args[0].detach().clone(),
                              "autocast": torch.is_autocast_enabled("cpu"), "dtype": str(torch.get_autocast_dtype("cpu")),
                              "rng": torch.get_rng_state()})

    # optimizer steps

    def before_step(self, optimizer, args, kwargs) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads if g is not None])).item() \
            if any(g is not None for g in grads) else 0.0
        moments = []
        for p in params:
            state = optimizer.state.get(p, {})
            moments.append({k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
        record = {"optimizer": type(optimizer).__module__ + "." + type(optimizer).__qualname__,
                  "lr": [float(g["lr"]) for g in optimizer.param_groups],
                  "weight_decay": [float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups],
                  "group_sizes": [len(g["params"]) for g in optimizer.param_groups],
                  "param_ids": [id(p) for p in params], "weights": _clone(params), "grads": _clone(grads),
                  "grad_norm": norm, "moments": moments}
        model = self.trained_model()
        if model is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            record["names"] = [names.get(id(p), "") for p in params]
        self.steps.append(record)

    def after_step(self, optimizer, args, kwargs) -> None:
        self.after.append({"torch": torch.get_rng_state(), "python": _python_state(), "numpy": _numpy_state()})
        if self.kill_at is not None and len(self.steps) == self.kill_at:
            self.write(None)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no destroy_process_group

    # files

    def recording_save(self, obj, f, *args, **kwargs):
        where = _file_name(f)
        if where is None:  # into memory: torch.distributed pickles objects this way (all_gather_object)
            return self.real_save(obj, f, *args, **kwargs)
        keys = sorted(str(k) for k in obj) if isinstance(obj, dict) else None
        self.saves.append({"path": str(where), "step": len(self.steps), "keys": keys, "torch_rng": torch.get_rng_state(),
                           "python_rng": _python_state(), "numpy_rng": _numpy_state()})
        return self.real_save(obj, f, *args, **kwargs)

    def recording_load(self, f, *args, **kwargs):
        where = _file_name(f)
        if where is None:
            return self.real_load(f, *args, **kwargs)
        weights_only = kwargs.get("weights_only")  # keyword-only in torch.load; None means its default, True
        entry = {"path": str(where), "weights_only": weights_only, "step": None}
        self.loads.append(entry)
        obj = self.real_load(f, *args, **kwargs)
        if isinstance(obj, dict) and isinstance(obj.get("step"), int):
            entry["step"] = obj["step"]
        return obj

    def install(self, script: str) -> None:
        """Patch torch, DDP, the sampler, the task's problems and the learner's classes, before the script runs."""
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data.distributed import DistributedSampler

        probe = self
        real_ddp_init, real_set_epoch, real_iter = DistributedDataParallel.__init__, DistributedSampler.set_epoch, DistributedSampler.__iter__

        def ddp_init(ddp, module, *args, **kwargs):
            probe.ddp_wraps.append(any(module is m for m in probe.models))
            real_ddp_init(ddp, module, *args, **kwargs)

        def set_epoch(sampler, epoch):
            probe.epochs.append(int(epoch))
            return real_set_epoch(sampler, epoch)

        def sampler_iter(sampler):
            order = [int(i) for i in real_iter(sampler)]
            probe.orders.append({"epoch": int(sampler.epoch), "indices": order})
            return iter(order)

        DistributedDataParallel.__init__ = ddp_init
        DistributedSampler.set_epoch = set_epoch
        DistributedSampler.__iter__ = sampler_iter
        torch.save, torch.load = self.recording_save, self.recording_load
        register_optimizer_step_pre_hook(self.before_step)
        register_optimizer_step_post_hook(self.after_step)

        settings = json.loads((self.folder / "probe.json").read_text())
        if settings.get("problems") is not None:
            from course_utils import addition

            chosen = [tuple(p) for p in settings["problems"]]
            addition.training_problems = lambda: list(chosen)
        folder = os.path.dirname(os.path.abspath(script))
        sys.path.insert(0, folder)  # as `python script.py` does: the learner's modules sit beside the script
        with contextlib.suppress(Exception):  # a module that does not import fails in the script, where it is reported
            import capstone_model

            self.watch_model_class(capstone_model.TinyGPT)
        with contextlib.suppress(Exception):
            import capstone_data

            self.watch_dataset_class(capstone_data.AdditionDataset)

    def trained_model(self) -> torch.nn.Module | None:
        """The TinyGPT that ran the most training forwards (the first one made, before any forward)."""
        if not self.models:
            return None
        counts = [sum(f["model"] == i for f in self.forwards) for i in range(len(self.models))]
        return self.models[max(range(len(counts)), key=counts.__getitem__)]

    def write(self, error: dict | None) -> None:
        import torch.distributed as dist

        model = self.trained_model()
        final = {k: v.detach().clone() for k, v in model.state_dict().items()} if model is not None else None
        record = {"rank": self.rank, "error": error, "steps": self.steps, "after": self.after, "forwards": self.forwards, "reads": self.reads,
                  "epochs": self.epochs, "orders": self.orders, "saves": self.saves, "loads": self.loads,
                  "ddp_wraps": self.ddp_wraps, "models": len(self.models), "final": final,
                  "initialized_at_end": dist.is_available() and dist.is_initialized(), "killed": error is None and self.kill_at is not None
                  and len(self.steps) == self.kill_at}
        self.real_save(record, self.folder / f"rank{self.rank}.pt")


def _error_record(err: BaseException, script: str) -> dict:
    """One rank's exception: its type, first line, the untouched stub it reached if any, and where in the learner's files."""
    from course_utils.tooling.checks import stub_frame

    folder = os.path.dirname(os.path.realpath(script))
    tb, frame = err.__traceback__, None
    while tb is not None:
        filename = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if os.path.dirname(filename) == folder:
            frame = (tb.tb_frame.f_code.co_name, tb.tb_lineno, os.path.basename(filename))
        tb = tb.tb_next
    stub_at = stub_frame(err)
    stub = None
    if stub_at is not None and os.path.dirname(os.path.realpath(stub_at[1])) == folder:
        stub = {"function": stub_at[0], "file": os.path.basename(stub_at[1])}
    lines = str(err).strip().splitlines()
    return {"type": type(err).__name__, "message": lines[0] if lines else "", "stub": stub,
            "function": frame[0] if frame else None, "line": frame[1] if frame else None,
            "file": frame[2] if frame else None, "time": time.time()}


def run_rank() -> None:
    """One rank of a script run by lesson 11's check (sys.argv: -c, the script, its arguments), the probe in place."""
    script, *args = sys.argv[1:]
    folder = Path(os.environ[PROBE_ENV])
    settings = json.loads((folder / "probe.json").read_text())
    probe = Probe(int(os.environ["RANK"]), folder, settings.get("kill_at"))
    probe.install(script)
    sys.argv = [script, *args]
    error, code = None, 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code:
            error = {"type": "SystemExit", "message": f"exit code {code}", "stub": None, "function": None, "line": None,
                     "file": None, "time": time.time()}
    except BaseException as err:  # noqa: BLE001 -- every error is the learner's, reported by the check
        error, code = _error_record(err, script), 1
        import traceback

        traceback.print_exc()
    probe.write(error)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter shutdown: the process group may be left in any state


# Starting the ranks: course_utils.rank_server forks every rank of every run from one process that imported torch.

@dataclass
class RankRun:
    """What one rank of a launched script did: exit code, output, the probe's record, and whether the launcher killed it."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    record: dict | None
    stopped: bool


class RankServer(rank_server.RankServer):
    """A rank server that launches lesson 11's runs, each rank under this module's probe."""

    def launch(self, script: Path, args: list[str], folder: Path, *, world_size: int = 2, problems=None,
               kill_at: int | None = None, timeout: float = 20.0, grace: float = 5.0, cwd: Path | None = None) -> list[RankRun]:
        """Run `world_size` ranks of the script as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment),
        each under the probe, its record in `folder`."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "probe.json").write_text(json.dumps({"problems": problems, "kill_at": kill_at}))
        env = {"TORCHELASTIC_RUN_ID": "lesson11-check", PROBE_ENV: str(folder)}
        result = self.run(__name__, script, args, folder, env, world_size=world_size, timeout=timeout, grace=grace, cwd=cwd)
        return [RankRun(rank, result["returncodes"][rank], *rank_server.rank_files(folder, rank), rank in result["stopped"])
                for rank in range(world_size)]
