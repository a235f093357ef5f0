"""Checkpoint paths (the `staged-checkpoints` and `tinker-sampler-paths` changes): txflow names checkpoints as Tinker
does, the SDK's own parser takes every name txflow gives, and upstream's old sampler form still maps to the same
file."""

from __future__ import annotations

import pytest
from tinker import types

from txflow.upstream.skyrl_tx import layout

FILES = {"state": "model_ab12/step-000003.tar.gz", "sampler": "model_ab12/sampler_weights/step-000003.tar.gz"}


@pytest.mark.parametrize("kind, sdk_kind, middle", [("state", "training", "weights"),
                                                    ("sampler", "sampler", "sampler_weights")])
def test_each_checkpoint_has_tinkers_path_and_the_sdk_parses_it(kind, sdk_kind, middle):
    path = layout.tinker_path("model_ab12", kind, "step-000003")
    assert path == f"tinker://model_ab12/{middle}/step-000003"
    assert layout.tinker_path_for(FILES[kind]) == path
    assert layout.relative_checkpoint_path(path) == FILES[kind]
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)  # the SDK's helpers all start here
    assert (parsed.training_run_id, parsed.checkpoint_type) == ("model_ab12", sdk_kind)


def test_upstreams_sampler_form_is_still_read_as_the_same_checkpoint():
    old = "tinker://model_ab12/step-000003"  # what SkyRL-tx 0.3.0 answered, and clients may still hold
    with pytest.raises(ValueError, match="Invalid tinker path"):
        types.ParsedCheckpointTinkerPath.from_tinker_path(old)  # why txflow no longer answers it
    assert layout.parse_tinker_path(old) == ("model_ab12", "sampler", "step-000003")
    assert layout.relative_checkpoint_path(old) == FILES["sampler"]


def test_what_is_not_a_checkpoint_path_is_refused():
    with pytest.raises(ValueError, match="not a tinker checkpoint path"):
        layout.parse_tinker_path("tinker://model_ab12/weights/a/b")
    assert layout.tinker_path_for("model_ab12/notes.txt") is None


def test_ephemeral_samplers_and_external_weights_exports_are_not_committed_named_samplers_are():
    assert layout.is_ephemeral_sampler("model_ab12/sampler_weights/ss1_seq4.tar.gz")
    assert layout.is_ephemeral_sampler("model_ab12/sampler_weights/external_weights-download.tar.gz")
    assert not layout.is_ephemeral_sampler("model_ab12/sampler_weights/final.tar.gz")
    assert not layout.is_ephemeral_sampler("model_ab12/external_weights-download.tar.gz")  # a state
