"""What the viewer knows: the runs it finds (run folders, gateway stores), one StoreView per store
file, and a run's overview and phases, as the API answers them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from openforgerl.run.folder import GATEWAY_STORE, METRICS, TIMINGS
from openforgerl.run_status import read_status
from openforgerl.store.view import StoreView
from openforgerl.ui.compare import comparable_groups, eval_key
from openforgerl.ui.runs import (
    MetricsFile,
    Run,
    eval_reports,
    model_dir_of,
    phases_of,
    read_config,
    read_json,
    report_headline,
    run_folders,
    run_status,
    runner_progress,
    step_order,
)

DISCOVERY_TTL = 2.0  # seconds a run listing is reused: polls from several tabs share one scan
NO_RUN_ID = "(no run id)"  # the run of rollouts opened without a run_id


@dataclass
class ViewerConfig:
    store: Path | None = None  # a gateway store (its rollouts' run_ids become runs)
    runs: Path | None = None  # a folder of run folders (or one run folder)
    model: Path | None = None  # the tokenizer for every run (else each run's config names one)
    token: str = ""  # required on every request when set
    create_indexes: bool = False  # the only write: VIEWER_INDEXES on the stores, IF NOT EXISTS
    poll_seconds: float = 3.0  # how often the front end polls an active run


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class Viewer:
    """Finds runs, holds one StoreView per store file, answers the API."""

    def __init__(self, cfg: ViewerConfig) -> None:
        if cfg.store is None and cfg.runs is None:
            raise ValueError("give a store, a runs folder, or both")
        if cfg.runs is not None and not cfg.runs.is_dir():
            raise FileNotFoundError(f"no runs folder at {cfg.runs}")
        self.cfg = cfg
        self._lock = threading.Lock()
        self._stores: dict[Path, StoreView] = {}
        self._metrics: dict[Path, MetricsFile] = {}
        self._runs: dict[str, Run] = {}
        self._runs_at = 0.0
        if cfg.store is not None:
            self.store_view(cfg.store)  # a wrong --store fails at start, not on the first page

    def close(self) -> None:
        for view in self._stores.values():
            view.close()

    def store_view(self, path: Path) -> StoreView:
        key = path.resolve()
        with self._lock:
            if key not in self._stores:
                self._stores[key] = StoreView(key, create_indexes=self.cfg.create_indexes)
            return self._stores[key]

    def metrics(self, folder: Path) -> MetricsFile:
        key = (folder / METRICS).resolve()
        with self._lock:
            return self._metrics.setdefault(key, MetricsFile(key))

    def missing_indexes(self) -> dict[str, list[str]]:
        with self._lock:
            return {str(p): v.missing_indexes for p, v in self._stores.items() if v.missing_indexes}

    # -- runs -------------------------------------------------------------------------------
    def runs(self, fresh: bool = False) -> dict[str, Run]:
        if fresh or time.monotonic() - self._runs_at > DISCOVERY_TTL:
            self._runs, self._runs_at = self._discover(), time.monotonic()
        return self._runs

    def _discover(self) -> dict[str, Run]:
        runs: dict[str, Run] = {}
        main = self.cfg.store.resolve() if self.cfg.store else None
        claimed: set[str] = set()  # run_ids of the main store that a folder stands for
        for name, folder, parent in run_folders(self.cfg.runs) if self.cfg.runs else []:
            own = folder / GATEWAY_STORE
            if own.is_file() and own.resolve() != main:
                ids = self.store_view(own).run_ids()
                if folder.name in ids or len(ids) <= 1:
                    # An eval's run_id is its folder's name; a store with one run_id is that run's.
                    primary = folder.name if folder.name in ids or not ids else ids[0]
                    runs[name] = Run(name, primary, folder, own, parent)
                    others = [rid for rid in ids if rid != primary]
                else:
                    # A trainer's store: one run_id per step (rl-step1, rl-step2, ...), steps of one
                    # run; the run's own rollouts are its last step's.
                    others = sorted(ids, key=step_order)
                    runs[name] = Run(name, others[-1], folder, own, parent, steps=others)
                for rid in others:
                    runs[f"{name}#{rid}"] = Run(f"{name}#{rid}", rid, folder, own, parent, step_of=name)
            else:
                runs[name] = Run(name, folder.name, folder, main, parent)
                claimed.add(folder.name)
        if main is not None:
            for rid in self.store_view(main).run_ids():
                name = rid or NO_RUN_ID
                if rid not in claimed and name not in runs:
                    runs[name] = Run(name, rid, None, main)
        return runs

    def run(self, request: Request) -> Run:
        name = request.query_params.get("run")
        if name is None:
            raise ApiError(400, "the 'run' parameter is required", "run")
        run = self.runs().get(name) or self.runs(fresh=True).get(name)
        if run is None:
            raise ApiError(404, f"no run named {name!r}", "run")
        return run

    def model_for(self, run: Run) -> Path | None:
        if self.cfg.model is not None:
            return self.cfg.model
        return model_dir_of(read_config(run.folder)) if run.folder else None

    def phase_record(self, run: Run) -> dict[str, Any] | None:
        """The run's entry in its parent's status.json phases (the demo records each phase)."""
        parent = self.runs().get(run.parent) if run.parent else None
        if parent is None or parent.folder is None or run.folder is None:
            return None
        for phase in phases_of(read_status(parent.folder)).values():
            folder = phase.get("folder")
            if isinstance(folder, str) and (parent.folder / folder).resolve() == run.folder.resolve():
                return phase
        # A demo from before status.json: timings.json has the seconds of each phase that finished.
        timings = read_json(parent.folder / TIMINGS)
        key = run.name.removeprefix(f"{parent.name}/").replace("/", "-")
        if isinstance(timings, dict) and key in timings:
            return {"state": "finished", "seconds": timings[key], "source": "the run's timings.json"}
        return None

    def run_overview(self, run: Run, *, detail: bool) -> dict[str, Any]:
        totals = self.store_view(run.store).run_totals(run.run_id) if run.store else None
        progress = runner_progress(run.folder) if run.folder and not run.step_of else {}
        rows = self.metrics(run.folder).read() if run.folder and not run.step_of else []
        last = rows[-1] if rows else None
        open_rollouts = totals["by_status"].get("open", 0) if totals else 0
        if run.step_of:
            status = {"state": "finished" if not open_rollouts else "running", "source": "store"}
        else:
            status = run_status(run.folder, progress, open_rollouts, self.phase_record(run))
        out: dict[str, Any] = {
            "name": run.name,
            "run_id": run.run_id,
            "folder": str(run.folder) if run.folder else None,
            "store": str(run.store) if run.store else None,
            "parent": run.parent,
            "step_of": run.step_of,
            "status": status,
            "progress": progress,
            "totals": totals,
            # Training steps: a step 0 line holds the starting policy's measurements (headroom, eval).
            "steps": len({r["step"] for r in rows if r["step"] > 0}) or len(run.steps),
            "last_metrics": last,
            "report": report_headline(run.folder) if run.folder and not run.step_of else None,
        }
        if detail:
            model = self.model_for(run)
            out["config"] = read_config(run.folder) if run.folder else {}
            out["model"] = str(model) if model else None
            out["evals"] = eval_reports(run.folder) if run.folder and not run.step_of else []
            out["poll_seconds"] = self.cfg.poll_seconds
            out["phases"] = self.phases(run)
            out["step_runs"] = [
                {
                    "name": f"{run.name}#{rid}",
                    "run_id": rid,
                    "totals": self.store_view(run.store).run_totals(rid),
                }
                for rid in run.steps
                if run.store
            ]
            out["comparisons"] = comparable_groups(
                [(p["run"], p["eval"]) for p in out["phases"] if p.get("run") and p.get("eval")]
            )
        return out

    def phases(self, top: Run) -> list[dict[str, Any]]:
        """The run's phases: those its status.json records, in its order (each with the run folder
        it wrote, when that is a run), then the run folders below it that the record does not name."""
        runs = self.runs()
        below = [r for r in runs.values() if not r.step_of and r.folder and r.name.startswith(f"{top.name}/")]
        by_folder = {r.folder.resolve(): r for r in below if r.folder}
        out: list[dict[str, Any]] = []
        named: set[str] = set()
        recorded = phases_of(read_status(top.folder)) if top.folder else {}
        for label, phase in recorded.items():
            folder = phase.get("folder")
            run = (
                by_folder.get((top.folder / folder).resolve())
                if top.folder and isinstance(folder, str)
                else None
            )
            out.append(self._phase_row(label, phase, run))
            if run is not None:
                named.add(run.name)
        # A demo from before status.json: its timings.json names the phases in the order they ran.
        timings = read_json(top.folder / TIMINGS) if top.folder else None
        order = list(timings) if isinstance(timings, dict) else []

        def ran(run: Run) -> int:
            key = run.name.removeprefix(f"{top.name}/").replace("/", "-")
            return order.index(key) if key in order else len(order)

        for run in sorted(below, key=ran):
            if run.name not in named:
                out.append(self._phase_row(run.name.removeprefix(f"{top.name}/"), None, run))
        return out

    def _phase_row(self, label: str, phase: dict[str, Any] | None, run: Run | None) -> dict[str, Any]:
        row: dict[str, Any] = {"phase": label, "run": run.name if run else None}
        if run is not None:
            overview = self.run_overview(run, detail=False)
            row |= {
                k: overview[k] for k in ("status", "steps", "last_metrics", "report", "totals", "progress")
            }
            row["eval"] = eval_key(run.folder) if run.folder else None
        else:
            at = (phase or {}).get("finished_at") or (phase or {}).get("started_at")
            row["status"] = {**(phase or {}), "source": "the run's status.json", "changed_at": at}
            row["folder"] = (phase or {}).get("folder")
        return row

    def rollout(self, request: Request) -> tuple[Run, Any]:
        run = self.run(request)
        rollout_id = request.query_params.get("id")
        if not rollout_id:
            raise ApiError(400, "the 'id' parameter (a rollout id) is required", "id")
        found = self.store_view(run.store).rollout(rollout_id) if run.store else None
        if found is None or found[0].run_id != run.run_id:
            raise ApiError(404, f"no rollout {rollout_id!r} in run {run.name!r}", "id")
        return run, found
