"""export-adapter and `txflow export`: a run's checked sampler checkpoint as a PEFT adapter (and, on request, the
merged model), proven outside SkyRL-tx and committed only when the proof holds; and the run card its model card
shows, one shape whether the run is at hand (the flow) or read back from its report (the CLI)."""

from __future__ import annotations

import threading

import fsspec

from txflow.artifacts import writer
from txflow.artifacts.conversion import available_base_model
from txflow.checkpoints import export
from txflow.checkpoints.export import ExportResult
from txflow.config import NAMED_MODELS, TINY_MODEL, RunConfig
from txflow.log import get_logger, scrub
from txflow.results import Discovered, Exported, RestoreCheck

# The report's restore block holds the checks and the quality figures side by side; these are the figures.
_QUALITY_SUFFIXES = ("_gain", "eval_loss", "eval_reward", "_p")


def run_card(run_id: str | None, mode: str, steps: int, base_model: str, dataset: str | None, quality: dict) -> dict:
    """What an export's model card says of the run it came from."""
    return {"run_id": run_id, "mode": mode, "steps": steps, "base_model": base_model,
            "base_model_source": "tiny" if base_model == TINY_MODEL else "user",
            "dataset": scrub(dataset) if dataset else f"txflow's bundled {mode} dataset", "quality": quality}


def card_of_report(run_root: str, options: dict) -> dict:
    """The run card of the run whose report.json is in `run_root` ({} without a report)."""
    from txflow.reporting.report import RunReport

    fs, path = fsspec.core.url_to_fs(run_root, **options)
    try:
        report = RunReport.read(fs.cat_file(f"{path.rstrip('/')}/report.json"))
    except (FileNotFoundError, ValueError):
        return {}
    quality = {k: v for k, v in (report.restore or {}).items() if k.endswith(_QUALITY_SUFFIXES)}
    return run_card(report.run_id, report.mode, len(report.metrics), report.base_model, report.dataset, quality)


# One export at a time in a process (a sweep's members run in threads of one): transformers sets torch's
# process-wide default dtype while it builds a model, so a bf16 load in one thread made another's float32
# proof compute in bf16 (max |Δ logprob| 1.26) or fail ("unsupported scalarType"). Two exports on 2 cores
# would only share them anyway.
_ONE_EXPORT_AT_A_TIME = threading.Lock()


def run(cfg: RunConfig, restore: RestoreCheck) -> Exported:
    """Export the sampler checkpoint evaluate-restore checked, prove it outside SkyRL, commit it, and list
    the run root again (the manifest then names the export too)."""
    log = get_logger()
    options = cfg.plain_storage_options()
    reference = restore.reference
    if reference is None:
        raise RuntimeError("evaluate-restore recorded no reference figures, so no export can be proven")
    card = run_card(cfg.run_id, cfg.mode, cfg.steps, cfg.base_model, cfg.dataset, restore.quality)
    with _ONE_EXPORT_AT_A_TIME:
        result = writer.export(reference, f"{cfg.run_root}/{export.EXPORT_DIR}", options, reference.base_model,
                               card, merged=cfg.export.merged, keep_others=True, log=log.info,
                               signed_as=f"{cfg.run_id}/{export.EXPORT_DIR}")
    discovered = Discovered.list_run_root(cfg.run_root, options)
    if result.passed:
        found = {a.url: a for a in discovered.artifacts}
        for url in filter(None, (result.peft_url, result.merged_url)):
            listed = found.get(url)
            if listed is None or listed.kind != "export" or not (listed.complete and listed.committed):
                raise RuntimeError(f"The export at {url} is not listed as a complete, committed export: "
                                   f"{listed.reason if listed else 'not found'}")
        log.info(f"exported {result.peft_url}" + (f" and {result.merged_url}" if result.merged_url else "")
                 + f" in {result.seconds:.1f} s")
    else:
        log.error(f"export check FAILED: {export.failure(result)}")
    return Exported(result=result, discovered=discovered)


def url(where: str, to: str, options: dict, base_model: str | None = None, merged: bool = False,
        force: bool = False, log=print) -> ExportResult:
    """Export the checked sampler checkpoint of the run root (or sampler checkpoint) `where` to `to`, proven;
    ExportError (or ValueError) before anything is written when it cannot be."""
    from txflow.upstream.tiny_model import resolve_base_model

    run_root, reference = export.locate(where, options)
    card = card_of_report(run_root, options)
    if base_model:
        reference.base_model = available_base_model(base_model)
    elif card.get("base_model") in (TINY_MODEL, *NAMED_MODELS):
        # Built (or converted) here when this machine lacks it.
        reference.base_model = resolve_base_model(card["base_model"])
    else:
        reference.base_model = available_base_model(reference.base_model)
    with _ONE_EXPORT_AT_A_TIME:
        return writer.export(reference, to, options, reference.base_model, card, merged=merged, force=force,
                             log=log)
