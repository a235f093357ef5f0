"""The export: a run's sampler checkpoint as a Hugging Face PEFT adapter (and, on request, the merged model),
converted, proven against SkyRL-tx's figures, and committed only when the proof holds."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from txflow.artifacts.conversion import (
    compute_dtype,
    extract_sampler,
    model_card,
    peft_adapter,
    prepare_destination,
    serving_notes,
    ties_embeddings,
)
from txflow.artifacts.proof import figures, float32_noise, load_base, merge, prove
from txflow.checkpoints import storage
from txflow.checkpoints.export import (
    LOGPROB_BOUND,
    MERGED_DIR,
    PEFT_DIR,
    PROVENANCE_NAME,
    ExportReference,
    ExportResult,
    failure,
    logprob_bound,
    max_abs_diff,
    noise_note,
)


def export(reference: ExportReference, dest: str, options: dict, base_model_path: str, run: dict,
           merged: bool = False, force: bool = False, keep_others: bool = False, log=print,
           signed_as: str | None = None) -> ExportResult:
    """Export the sampler checkpoint of `reference` to `<dest>/peft` (and `<dest>/merged`), proven against
    the reference; committed only when the proof holds. `run` describes the run for the model card.
    `signed_as` is `dest`'s path below the checkpoint root (`<run id>/export`), which a signed marker binds;
    without it the markers bind `dest`'s whole path."""
    began = time.monotonic()
    kept = prepare_destination(dest, options, force, reference.sampler_url, keep_others)
    if kept:
        log(f"export: the earlier export at {dest} (of another sampler checkpoint) is kept at {kept}")
    with tempfile.TemporaryDirectory(prefix="txflow-export-") as tmp:
        staging = Path(tmp)
        tarball = staging / "sampler.tar.gz"
        storage.download(reference.sampler_url, tarball, options, directory=False)
        peft_dir = staging / PEFT_DIR
        config = peft_adapter(extract_sampler(tarball, staging / "sampler"), peft_dir, reference.base_model,
                              tied=ties_embeddings(base_model_path))
        found, model = prove(base_model_path, peft_dir, reference, tarball)
        diff = max_abs_diff(found.logprobs, found.expected.logprobs)
        # The model's float32 noise widens the bound (`logprob_bound`); it matters only when the PEFT model is
        # farther than LOGPROB_BOUND from its reference, or a merge will be held to the bound too. Its passes
        # (three float32 ones rounding their own way, one in float64) take 16.5 s on SmolLM2-135M.
        noise = float32_noise(model, reference, found.logprobs) if diff > LOGPROB_BOUND or merged else None
        result = ExportResult(
            sampler_url=reference.sampler_url, base_model=reference.base_model,
            target_modules=config["target_modules"], r=config["r"], lora_alpha=config["lora_alpha"],
            max_abs_logprob_diff=diff, float32_noise=noise, logprob_bound=logprob_bound(noise),
            greedy_tokens_match=found.greedy_tokens == found.expected.greedy_tokens,
            compared_against="the cluster's figures" if found.cluster_logprob_diff is None else
            f"SkyRL-tx's forward of the checkpoint in float32 (the cluster computed in "
            f"{compute_dtype(base_model_path)})",
            cluster_max_abs_logprob_diff=found.cluster_logprob_diff and found.cluster_logprob_diff[0],
            cluster_mean_abs_logprob_diff=found.cluster_logprob_diff and found.cluster_logprob_diff[1],
            notes=serving_notes(config, reference.base_model, base_model_path), passed=False)
        if found.unapplied:
            result.problem = (f"PEFT does not apply {len(found.unapplied)} adapter tensors as written: "
                              f"{', '.join(found.unapplied[:4])}")
        log(f"export: PEFT adapter of {reference.sampler_url}: max |Δ logprob| {result.max_abs_logprob_diff:.2e} "
            f"(bound {result.logprob_bound:.3g}{noise_note(result)}), greedy tokens match "
            f"{result.greedy_tokens_match}, against {result.compared_against}")
        if result.cluster_max_abs_logprob_diff is not None:
            log(f"export: the cluster's figures against SkyRL-tx's float32 forward of the checkpoint (the model's "
                f"dtype's noise, not checked): max |Δ logprob| {result.cluster_max_abs_logprob_diff:.3g}, mean "
                f"{result.cluster_mean_abs_logprob_diff:.3g}")
        merged_dir = staging / MERGED_DIR
        if merged:
            merge(model, base_model_path, merged_dir, config)
            again = figures(load_base(str(merged_dir)).eval(), reference)
            result.merged_max_abs_logprob_diff = max_abs_diff(again.logprobs, found.logprobs)
            result.merged_greedy_tokens_match = again.greedy_tokens == found.greedy_tokens
            log(f"export: merged model: max |Δ logprob| {result.merged_max_abs_logprob_diff:.2e} against the PEFT "
                f"model, greedy tokens match {result.merged_greedy_tokens_match}")
        result.passed = failure(result) is None
        if not result.passed:
            result.seconds = round(time.monotonic() - began, 3)
            return result  # a wrong export is never written where a user would find it
        dest = dest.rstrip("/")
        result.peft_url = f"{dest}/{PEFT_DIR}"
        result.merged_url = f"{dest}/{MERGED_DIR}" if merged else None
        for directory, is_merged in ((peft_dir, False), *(((merged_dir, True),) if merged else ())):
            (directory / "README.md").write_text(model_card(result, run, is_merged))
            (directory / PROVENANCE_NAME).write_text(json.dumps(
                {"sampler_url": reference.sampler_url, "run": run, "proof": result.model_dump(exclude={"seconds"})},
                indent=1) + "\n")
            storage.upload(directory, f"{dest}/{directory.name}", options,
                           "the merged model" if is_merged else "the PEFT adapter",
                           signed_as=f"{signed_as}/{directory.name}" if signed_as else None)
    result.seconds = round(time.monotonic() - began, 3)
    return result
