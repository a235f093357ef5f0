"""Every change txflow makes to SkyRL-tx 0.3.0, one record each, named by a slug.

Code, comments, tests and docs name a change by its slug (the `scanned-layers` change), never by a
position in a list. `scripts/gen_docs.py` renders this table as `docs/upstream-patches.md`, and
`tests/test_patches.py` checks that every slug named in backticks exists here. The Tinker SDK shims of
`tinker_compat` are a separate, numbered list (the `sdk-shims` change installs them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Patch:
    """One change to SkyRL-tx's behaviour."""

    slug: str
    module: str  # the modules of txflow/upstream/skyrl_tx/ that make the change, comma-separated
    what: str  # what txflow does instead
    why: str  # what goes wrong upstream
    until: str  # which upstream change makes it unnecessary


PATCHES: tuple[Patch, ...] = (
    Patch(
        slug="external-engine",
        module="api",
        what="We serve the same FastAPI app with a lifespan that only prepares the database, and start the "
             "engine ourselves with this interpreter (`api.serve_api`).",
        why="`python -m tx.tinker.api` starts the engine itself with `uv run --extra tinker --extra jax -m "
            "tx.tinker.engine ...` in its FastAPI lifespan. We install into a plain virtual environment (pip, and "
            "`uv pip` for speed), with no uv project that defines those extras, so the engine never starts.",
        until="upstream lets the API attach to an external engine.",
    ),
    Patch(
        slug="quiet-command-lines",
        module="api",
        what="Our lifespan logs nothing of the engine's command line, the engine gets the database URL through "
             "`TX_DATABASE_URL` (not argv, which `ps` shows), and every command line we log goes through "
             "`txflow.log.redact`.",
        why="The upstream lifespan logs the whole engine command line, database URL (password included) and all.",
        until="upstream's lifespan no longer logs the engine's command line (it goes with `external-engine`).",
    ),
    Patch(
        slug="device-mesh",
        module="launch",
        what="`launch.backend_config` derives a mesh whose product equals the device count, and a sampling batch "
             "that is a multiple of fsdp (sampling `num_samples=1` otherwise fails with fsdp > 1).",
        why="The default device mesh (fsdp=ep=tp=1) is wrong for more than one process (\"Array has no "
            "addressable shards\").",
        until="upstream derives its mesh from the device count.",
    ),
    Patch(
        slug="coordinator-bind",
        module="launch",
        what="Rank 0 gets `JAX_COORDINATOR_BIND_ADDRESS` (read by `jax.distributed.initialize`) so that it binds "
             "only the configured interface (`launch.coordinator_env`).",
        why="JAX's coordination service binds `[::]:<port>` (every interface) whatever host the coordinator "
            "address names; SkyRL-tx offers no setting for it.",
        until="upstream offers a bind address for the coordinator.",
    ),
    Patch(
        slug="staged-checkpoints",
        module="layout",
        what="The engine always writes to local staging and txflow commits (`txflow.checkpoints.storage`); the "
             "layout is named only in `layout` (`relative_checkpoint_path`, `tinker_path_for`). A checkpoint "
             "copied back from durable storage is registered in the engine's database "
             "(`layout.register_checkpoint`), the only way 0.3.0 serves a checkpoint it did not write itself.",
        why="`save_state` writes a DIRECTORY named `<name>.tar.gz`, `save_weights_for_sampler` a real tarball "
            "under `sampler_weights/`; on S3 the state never reaches the bucket.",
        until="upstream writes its checkpoints to durable storage itself and serves checkpoints it did not write.",
    ),
    Patch(
        slug="rank0-checkpoint-io",
        module="checkpoint_io",
        what="The engine and the workers run through this package (`engine`/`worker` entry points), which "
             "replaces three backend methods (`checkpoint_io.install_checkpoint_io`): a state save gathers the "
             "LoRA weights and their optimizer state to every host (a collective; LoRA state is megabytes, not "
             "the model) and rank 0 alone writes ONE file, `txflow-state.msgpack`, into the checkpoint "
             "directory; a state or sampler load reads the file on rank 0 and broadcasts its bytes. Every "
             "checkpoint file therefore lives on rank 0's node, the coordinator node where txflow commits it "
             "(`txflow.checkpoints.storage`) with fsspec. We gather and broadcast instead of teaching Orbax to "
             "write to S3 from every rank because the upstream path through cloudpathlib never reaches the "
             "bucket (see the notes), and one file per checkpoint is what the commit verifies cheaply.",
        why="No filesystem is shared between ranks. Upstream saves the training state with "
            "`flax...save_checkpoint_multiprocess` (Orbax): every rank writes its shards into a directory rank 0 "
            "creates, so with node-local disks the other ranks wait for a directory they never see (600 s, then "
            "\"Timed out waiting for array_metadatas base directory creation\"), and a restore needs every "
            "rank's shards on every node. Sampler weights are written by every rank, but a sampler txflow "
            "imports from durable storage exists only where the import ran.",
        until="upstream saves without a shared disk.",
    ),
    Patch(
        slug="default-sigterm",
        module="ranks",
        what="After initialize the engine and the workers get the default SIGTERM action back "
             "(`ranks.default_sigterm_after_distributed_init`).",
        why="SIGTERM does not stop a rank of a multi-process cluster: `jax.distributed.initialize` installs "
            "TSL's preemption notifier, which catches SIGTERM and only logs \"SIGTERM caught\", so every "
            "teardown waited out its grace period before SIGKILL. SkyRL-tx does nothing with preemption notices.",
        until="upstream handles preemption or exits on it.",
    ),
    Patch(
        slug="self-gated-startup",
        module="engine, worker",
        what="Every process starts at once and each entry point gates itself after its imports: a worker waits "
             "until the coordinator accepts connections (`worker.gate_on_coordinator`), the engine's request "
             "loop until the tables exist (`engine.waits_for_tables`).",
        why="A worker started before rank 0's JAX coordinator listens would lean on JAX's connection retries, "
            "and the engine polls database tables that only the API creates. Waiting for each in the "
            "orchestrator serialises ~8 s of imports per rank.",
        until="upstream orders its own start-up.",
    ),
    Patch(
        slug="broadcast-delete-model",
        module="engine",
        what="The engine's backend broadcasts `delete_model` too (`engine.broadcast_delete_model`).",
        why="Unloading a model frees its LoRA slot on rank 0 only: the distributed backend (`JaxBackend`) "
            "broadcasts `create_model` to the workers but not `delete_model`. After an unload, the next model "
            "gets one adapter index on rank 0 and another on the workers, and the first batched request that "
            "uses it fails (\"passed to device_put is not the same on each process\"; seen when a restore check "
            "loads sampler weights into a fresh slot).",
        until="upstream's `JaxBackend` broadcasts it.",
    ),
    Patch(
        slug="sdk-shims",
        module="tinker_compat",
        what="`api.serve_api` installs the shims of `tinker_compat`, which has its own numbered list (SDK shims "
             "1-7).",
        why="The API answers only what `tinker` 0.13 sends; newer SDKs (0.25, 0.38) call endpoints it lacks and "
            "speak protobuf.",
        until="upstream serves what the newer SDKs call (each shim says when it can go).",
    ),
    Patch(
        slug="result-wait",
        module="result_wait",
        what="`result_wait.wait_for_result` (served by tinker_compat's `retrieve_future`) is upstream's loop "
             "with sleeps of a tenth of the time waited so far, between 10 ms and 0.25 s: a result is noticed "
             "at most ~10% late, for ~20 more looks at the database per second of waiting early on, fewer "
             "later. With `wake-channel`, the schedule is only the fallback: a result is noticed when the "
             "engine's wake comes, with a look every 0.25 s besides.",
        why="`retrieve_future` long-polls the database with sleeps of 0.1 s growing by 1.5x up to 1 s, so it "
            "looks at 0.1, 0.25, 0.475, 0.81, 1.32, ... s: a result is noticed up to ~50% late. A 0.26 s "
            "training step came back at 0.3 or at 0.55 s, whichever side of a look it landed (the bimodal step "
            "times of the benchmark), and a 5 s request can wait 1 s more.",
        until="upstream's wait is tighter or notified.",
    ),
    Patch(
        slug="wake-channel",
        module="api, engine, txflow.upstream.wake",
        what="With `launch.wake_env` in both environments, each end sends the other a wake after the commits "
             "that matter (`txflow.upstream.wake`): the API after committing a new request (`create_future`'s "
             "session), the engine after completing futures (`_complete_futures`). The engine's 0.1 s sleep "
             "ends at a wake (after a 10 ms quiet spell, so that requests sent together are still batched "
             "together), and `wait_for_result` looks at once. Requests a client sends together reach the API "
             "together but are stored one after another (a few database round trips each, often more than "
             "those 10 ms apart on a busy machine): 13 of 20 toy RL steps had their samples taken in two "
             "passes. So the API's wake waits while another storing request is still being handled, and the "
             "last one sends it (`api.Burst`). The database stays the only source of truth; without wakes both "
             "ends poll as in `result-wait`.",
        why="The API and the engine find each other's work only by polling the database: besides the result "
            "wait (`result-wait`), the engine sleeps 0.1 s after every pass over its pending requests, so each "
            "request that arrives while it sleeps (every training step's) waits up to 0.1 s before the engine "
            "sees it; that was a third of a 0.3 s step.",
        until="upstream's engine is notified of work.",
    ),
    Patch(
        slug="tinker-losses",
        module="losses",
        what="The engine and the workers compute Tinker's losses and sums, with `loss:sum` in every result; the "
             "API refuses what cannot be served (stable_reinforce among them) with one line.",
        why="Upstream serves cross_entropy, importance_sampling and ppo (its clip hard-coded, `loss_fn_config` "
            "ignored) as means over each sequence's weights and over sequences; Tinker documents sums, "
            "configurable thresholds and beta, and cispo, dro and gspo.",
        until="upstream serves Tinker's losses as sums.",
    ),
    Patch(
        slug="lora-flags",
        module="lora_config",
        what="The API passes `train_attn`, `train_mlp` and `train_unembed` on, and refuses what the engine cannot "
             "train (nothing at all; the unembedding of a base model that ties it to its embeddings is served "
             "by `tied-head-lora`). It answers them in weights_info.",
        why="Upstream's create_model drops the request's train_attn, train_mlp and train_unembed, so every "
            "adapter trains attention and MLP whatever the client asked. Upstream's weights_info leaves them out "
            "too, and SDKs up to 0.25 recreate a state's adapter from it (`create_training_client_from_state`) "
            "with every flag True.",
        until="upstream passes them on and answers them.",
    ),
    Patch(
        slug="api-key-check",
        module="auth",
        what="`auth.install` puts a check in front of every route but the health check: a request must carry the "
             "run's key in `X-API-Key` or as `Authorization: Bearer`, compared in constant time, else 401; the "
             "key reaches the API through its environment, never a command line. A shared cluster also lets in "
             "the keys of its attached runs, each scoped to what that run created (403 otherwise). A signed "
             "checkpoint download (`rest-surface`) is the one other way in.",
        why="SkyRL-tx 0.3.0's API checks no key: anyone who reaches its port can create sessions, sample, save "
            "weights, load states and unload the run's model; and it has no owners, so keys cannot be scoped.",
        until="upstream checks keys, scopes them and signs its download URLs.",
    ),
    Patch(
        slug="compilation-cache",
        module="ranks",
        what="Every rank writes under JAX's own conditions; `startup.child_env` also caches programs that "
             "compile in under 1 s (most of those 270).",
        why="JAX 0.10.2 (which upstream pins) writes the persistent compilation cache from process 0 only, and "
            "a rank's cache keys are its own, so rank 1 and up compiled every program again on every start: "
            "~270 on a 2-process cluster of the tiny model, 27 s to ready and a 15 s first step against 12 s "
            "and 4 s once they write their own entries.",
        until="JAX writes the cache from every process (tests/test_compilation_cache.py's control then fails).",
    ),
    Patch(
        slug="compile-log",
        module="ranks",
        what="Each shape of a train, forward or sampling program is logged when it first runs (`JIT compiling for "
             "forward seq_len=64 ...`), and so is the optimizer's program; the line at its end says how much of the "
             "first call went to making the program (tracing, lowering, compiling or loading: JAX's own events), "
             "how many of its executables JAX's persistent cache held and what compiling them had taken "
             "(`count_cache_events`). The run says what it waits for, whether it compiled or loaded, and its "
             "report adds up each program's compile seconds, without the first run that follows "
             "(tests/test_compile_log.py).",
        why="Upstream logs a compile the first time it meets a length, as `train` for a forward_backward and a "
            "forward alike and as `sample` for every sampling program of that length: a forward, another "
            "micro-batch row count, or a sampling batch with prompt logprobs or another new-token count "
            "compiled in silence after the first of its length (the demo's evaluation forward: 4.8 s, in no "
            "report).",
        until="upstream keys its compile log by the program's shape.",
    ),
    Patch(
        slug="load-optimizer-flag",
        module="tinker_compat, engine, checkpoint_io",
        what="The API stores the flag with the request (`tinker_compat.load_weights`), the engine passes it on "
             "(`engine.loads_optimizer_when_asked`) and every rank honours it (`checkpoint_io`: without it, the "
             "model gets a new model's optimizer).",
        why="Tinker's `load_state` (and `create_training_client_from_state`) loads the weights and starts the "
            "optimizer afresh; `load_state_with_optimizer` (`..._from_state_with_optimizer`) restores Adam's "
            "moments too. Every SDK sends that as load_weights' `optimizer` flag, but 0.3.0's "
            "`LoadWeightsRequest` has no such field: the flag was dropped and every load restored both, so an "
            "RL run started \"from the SFT weights\" carried the SFT optimizer.",
        until="upstream honours the flag (current upstream SkyRL does).",
    ),
    Patch(
        slug="tinker-sampler-paths",
        module="engine, layout",
        what="The engine answers Tinker's form (`engine.sampler_paths_as_tinkers`) and txflow names sampler "
             "checkpoints so (`layout.tinker_path`); the old form is still accepted wherever a client sends a "
             "path (upstream's asample and txflow's `layout`).",
        why="`save_weights_for_sampler` answers `tinker://<model_id>/<name>` (`tx/tinker/engine.py`), where "
            "Tinker answers `tinker://<run_id>/sampler_weights/<name>`; the SDK's "
            "`ParsedCheckpointTinkerPath.from_tinker_path` refuses the former, so every SDK helper that takes a "
            "checkpoint path (archive URL, weights info, delete, publish) failed in the client before sending "
            "anything.",
        until="upstream answers Tinker's form.",
    ),
    Patch(
        slug="sampling-params",
        module="tinker_compat",
        what="`tinker_compat.sample_request` reads a lone string as a list and refuses each option it cannot "
             "serve with one line (400).",
        why="The SDKs type `stop` as a string, strings or token ids; upstream's `SamplingParams` takes only "
            "lists, so a lone string got a 422. And upstream accepts `topk_prompt_logprobs` (0.38 adds "
            "`topk_sample_logprobs`, `target_prompt_logprobs`, `prompt_alt_tokens_k`, `prompt_logprobs_last_n`, "
            "`record_stability_info`) and answers without them.",
        until="upstream reads the SDK's types and serves those options.",
    ),
    Patch(
        slug="prompt-logprobs",
        module="engine",
        what="The engine puts the None first (`engine.prompt_logprobs_as_tinkers`).",
        why="Tinker answers one prompt logprob per prompt token, None for the first (which has no context; the "
            "SDKs document \"[len(tokens)], None at position 0\"); upstream answers len - 1, so entry i was the "
            "logprob of token i + 1 and a client that indexes by position read its neighbour's.",
        until="upstream does.",
    ),
    Patch(
        slug="one-adapter-batches",
        module="engine",
        what="Every batch the engine runs holds one adapter's requests (`engine.batches_of_one_adapter`). A "
             "sampling batch takes the first pending request's model and checkpoint, or the base model; the "
             "others wait for a batch of their own. A forward or forward_backward batch of several models runs "
             "as one batch per model, in order, in the same pass (a model's optimizer step comes after all its "
             "gradients, as upstream orders them). Every batch then runs on one slot's view "
             "(`one-slot-gradient`), and a run's figures do not depend on what other runs send at the same moment "
             "(tests/test_full_sampling_batches.py, tests/test_view_rows.py, tests/test_shared_cluster_e2e.py).",
        why="Upstream batches the pending requests of any models together. A batch of several adapters runs "
            "another program than a batch of one, and in bfloat16 the two round a row's figures apart (SmolLM2: a "
            "sampled token's logprob 0.125-0.5 off, then other greedy tokens). One or two members of a 3-member "
            "real-model sweep failed their restore check, whose live and restored samplers had met different "
            "neighbours, and the same sweep trained its members to other losses each time.",
        until="upstream's programs round alike whatever adapters a batch holds.",
    ),
    Patch(
        slug="requests-in-order",
        module="engine",
        what="A model's single requests (an optimizer step, a save, a load, an unload) wait for the next pass of "
             "the engine while an earlier forward, forward_backward or sample of that model is pending that this "
             "pass did not take (`engine.each_models_requests_in_order`; tests/test_requests_in_order.py).",
        why="Upstream's pass looks for model passes, then samples, then single requests, each a read of its own, and "
            "runs them in that order: a forward_backward stored after the first look and its optimizer step stored "
            "before the last ran step first, which found no gradient, and the next step took two. txflow's sampling "
            "look waits up to a second for its batch to fill (`full-sampling-batches`), so a run training beside "
            "one that samples met it: a toy sweep member's third loss was its second's (tests/"
            "test_shared_cluster_e2e.py compares a member with its run alone).",
        until="upstream orders each model's requests.",
    ),
    Patch(
        slug="full-sampling-batches",
        module="engine",
        what="When the pending sampling requests leave room in the batch, the engine looks again every 50 ms and "
             "takes what came meanwhile, until none comes: for 50 ms when the batch holds one request, for 150 ms "
             "when it holds several (a burst still being stored), at most 1 s in all "
             "(`engine.fills_sampling_batches`). A lone request waits 50 ms.",
        why="Upstream's engine takes the sampling requests pending at the moment it looks, at most "
            "`sample_max_num_sequences`, and pads the batch to that size. A client's requests sent together are "
            "stored one after another: the demo's 32 evaluation samples (8 a batch) ran as 2 + 8 + 8 + 8 + 6, "
            "five batches of a full one's cost instead of four, in two of its three evaluations. A wait of 20 ms "
            "was too short for the SDK's first request on a new sampling client, which came ~30 ms before the "
            "rest on a busy machine: the nightly's RL evaluations ran 1 + 8 + 8 + 7 requests, the lone one in a "
            "program of its own (loaded in 4 s, compiled in 15 s on a first run). Within a burst the API stored one of "
            "the demo's 32 evaluation requests 109 ms after the one before it: a batch that waits 50 ms for the "
            "next request samples it alone (4.8 s on SmolLM2; 4 of 10 demo runs), hence the longer wait once "
            "a batch holds several.",
        until="upstream batches continuously.",
    ),
    Patch(
        slug="rest-surface",
        module="rest, auth",
        what="The archive URL is signed for that one checkpoint and expires (`auth.DownloadSigner`, a secret per "
             "API process; the key check lets a valid signature through to that download alone, 403 "
             "otherwise), in both path forms and for states too. `list_user_checkpoints`, the sessions, "
             "`last_checkpoint` and get_info's `lora_rank` are served from the database. Delete, publish, TTLs "
             "and `overwrite` are refused in one line naming the txflow command that does the job (txflow's "
             "durable copy and its prune rules decide what goes). SDK 0.38's external weights (how its `tinker "
             "checkpoint download` fetches a state) are served as sampler saves with files signed one by one; "
             "the hosted service's routes (billing, audit, projects, traces, `copy_weights`, server-side custom "
             "losses) are refused in one line instead of a bare 404.",
        why="Upstream's archive URL redirects to a download that the key check (`api-key-check`) covers, so "
            "`tinker checkpoint download` and the cookbook's urllib download, which send no key, got 401; and "
            "with `tinker-sampler-paths` the SDK asks for `.../checkpoints/sampler_weights/<name>/archive`, "
            "which no upstream route matched. `list_user_checkpoints`, the sessions, `last_checkpoint` and "
            "get_info's `lora_rank` were 404 or empty.",
        until="upstream serves these routes and signs its download URLs.",
    ),
    Patch(
        slug="loss-chunks",
        module="ranks",
        what="Every rank sizes the chunks to the batch (`ranks.balanced_chunk`): as many chunks as the "
             "configured size needs, as even as can be, never larger, so the memory bound stays and the padding "
             "is below one token per chunk. txflow configures 128 positions (`models.LOGPROBS_CHUNK`, "
             "`launch.backend_config`): a chunk's float32 logits over SmolLM2's vocabulary are 25 MB instead of "
             "200, and a forward of 8 x 64 tokens peaked ~100 MB lower, a forward_backward of 8 x 96 tokens "
             "~200 MB, at the same step times.",
        why="Upstream computes a batch's logprobs in chunks of `loss_chunk_size` tokens (1024 by default) and "
            "pads the batch's tokens to a multiple of it, so 4 sequences bucketed to 48 tokens (192 tokens) "
            "computed the logits of 1024 rows over the whole vocabulary (49,152 for SmolLM2), and their "
            "backward: the largest part of a small step on a real model.",
        until="upstream sizes its chunks to the batch (or stops padding to a whole chunk).",
    ),
    Patch(
        slug="lora-per-example",
        module="ranks",
        what="Every rank's LoRA linear layers gather each example's own A and B and multiply "
             "(`ranks.lora_per_example`; same outputs and gradients, tests/test_step_patches.py). A decoding step "
             "multiplies by every slot's A and B where they are instead, each row's own kept by a 0/1 mask: XLA "
             "hoisted the gathered copies out of the decoding loop, 1.8 GB of them for a 32-row SmolLM2 batch "
             "(its peak RSS in one process 4.9 -> 4.0 GB, 5.0 -> 4.8 s a batch, the same tokens). An embedding's "
             "LoRA reads each example's own A rows and B the same way (`ranks.embed_lora_per_example`); experts "
             "keep upstream's path.",
        why="A LoRA linear layer sorts the batch's tokens by adapter and runs `jax.lax.ragged_dot` against every "
            "one of the `max_lora_adapters` slots; XLA on CPU computes it densely for all of them, so with "
            "txflow's 8 slots every step did the LoRA work 8 times (measured on SmolLM2-135M, in-process, 4 "
            "sequences: forward+backward 4.8 s with 8 slots, 2.7 s with 2).",
        until="upstream's LoRA costs what the batch's adapters need.",
    ),
    Patch(
        slug="tied-head-from-arguments",
        module="models",
        what="The tied output head is resolved on the model a program rebuilds from its arguments.",
        why="Upstream stores the head of a model that ties it to its embeddings as a lambda bound to the "
            "embedding module the model was built with, so every jitted program read that module's concrete "
            "array: XLA got the 49,152 x 576 embedding of SmolLM2 as a constant and folded it "
            "(\"slow_operation_alarm: Constant folding ...\").",
        until="upstream does so.",
    ),
    Patch(
        slug="scanned-layers",
        module="models",
        what="The layers run under `jax.lax.scan` over their weights, stacked inside the program (the engine's "
             "state keeps upstream's per-layer layout), except a decode step (one token per row, with a KV "
             "cache), which keeps upstream's loop. Same figures (tests/test_scanned_layers.py). A decode step "
             "under the scan copied each layer's weights out of the stack: SmolLM2, 8 rows, bfloat16, 2 cores: "
             "0.23 s per step under the scan, 0.10-0.13 s in the loop; the sampling program compiles in 8 s "
             "instead of 4.",
        why="Upstream's decoder stacks loop over their layers in Python, so every program (training and its "
            "gradient, forward, the prefill and decode of sampling) traced and compiled each layer anew: 82-96 s "
            "per SmolLM2 program on 2 cores.",
        until="upstream scans its layers.",
    ),
    Patch(
        slug="scan-in-float32-on-cpu",
        module="models",
        what="On a CPU, a bfloat16 model's decoder layers run under the scan in float32: the stacked weights are "
             "widened once per call (the engine's frozen ones once, at the load: `base-layers-stacked`) and every "
             "submodule of the layer computes in float32 (on a CPU with bfloat16 dot instructions the projections "
             "multiply bfloat16 into float32 instead: `bfloat16-products-on-cpu`); the hidden state, KV cache, final "
             "norm and head keep the model's dtype, and so do its state, checkpoints and exports. "
             "Training and prefill figures move by bfloat16 rounding; float32 models compute what they did "
             "(tests/test_scanned_layers.py, which also holds the layers' dots to float32).",
        why="XLA's CPU runtime converts the operands of every bfloat16 dot; under the scan it does so per layer in "
            "the forward and again in the backward. SmolLM2's SFT step (4 x 64 tokens, 2 cores) took 3.59 s in "
            "bfloat16 and 1.89 s widened, its program compiled in 11 s instead of 15.",
        until="XLA's CPU backend computes bfloat16 dots at float32's speed.",
    ),
    Patch(
        slug="bfloat16-products-on-cpu",
        module="models",
        what="On a CPU with bfloat16 dot instructions (AMX's `amx_bf16` or AVX-512's `avx512_bf16`), a bfloat16 "
             "model's projections (every LoRA linear layer's base product, in the "
             "scan, the prefill and the decoding loop) and its tied head multiply bfloat16 operands into a float32 "
             "result, forward and backward (`models.bfloat16_product`); under the scan the layers' kernels are "
             "carried as their bits (uint16) and the rest of the layer computes in float32 as before "
             "(`scan-in-float32-on-cpu`). A product's result is rounded to the layer's dtype where upstream's is. "
             "Float32 models, and CPUs without either, compute what they did (tests/test_bfloat16_products.py). "
             "Each rank logs which way its CPU multiplies, once, after the base weights' load.",
        why="XLA's CPU runtime multiplies bfloat16 on the CPU's bfloat16 units only for a dot of bfloat16 operands "
            "into a float32 result; upstream's bfloat16 dots (bfloat16 results) are converted to float32 first, "
            "and a bfloat16 array a loop slices is widened to float32 before the loop. On SmolLM2 (2 cores, AMX) "
            "the SFT forward_backward took 0.98 s widened and 0.58 s so, a sampling batch 1.49 s and 0.86 s, and "
            "the sampling program's buffers fell from 1.52 to 0.90 GiB. On a CPU with AVX-512 BF16 and no AMX (AMD "
            "EPYC) 1.11 s against 1.82 s and 1.50 s against 2.25 s, the engine's peak 3.46 against 4.10 million KiB.",
        until="XLA's CPU backend multiplies bfloat16 dots with bfloat16 results on the CPU's bfloat16 units.",
    ),
    Patch(
        slug="embedding-rows-as-bits",
        module="models",
        what="On a CPU, a bfloat16 embedding's rows (the input tokens' embeddings, in training, the prefill and "
             "each decoding step) are taken from its bits (uint16) and read back as bfloat16: the same rows, bit "
             "for bit; its LoRA is upstream's (tests/test_bfloat16_products.py).",
        why="XLA's CPU runtime gathers from a bfloat16 array by widening all of it to float32 first: SmolLM2's "
            "embedding became a 108 MB float32 copy in every training and sampling program.",
        until="XLA's CPU backend gathers bfloat16 rows without widening the array.",
    ),
    Patch(
        slug="slots-written-in-place",
        module="ranks",
        what="A model's optimizer step, and a one-slot forward_backward's gradient sum (`one-slot-gradient`), "
             "are written into the slot-stacked LoRA weights and gradient sums in place: a program of its own "
             "whose arrays are donated, a bfloat16 array written through its bits (`ranks.slot_write_program`). "
             "Every slot's values stay as they were, bit for bit (tests/test_checkpoint_io.py, "
             "tests/test_slots_written_in_place.py).",
        why="XLA's CPU runtime widens a bfloat16 dynamic-update-slice to float32: writing one slot rewrote each "
            "whole 8-slot array (SmolLM2: 844 of them per optimizer step), converted twice, and freed the copies "
            "into the allocator. The optimizer step took 0.11-0.15 s and now 0.06 s; a process that trains and "
            "samples peaked at 4.1-4.8 GB and now 3.6 GB.",
        until="XLA's CPU backend updates bfloat16 slices in place.",
    ),
    Patch(
        slug="sampling-buckets",
        module="ranks",
        what="Prompts shorter than 64 tokens share one sampling bucket.",
        why="Each sampling prompt length bucket (32, 48, 64, ...) is a program of its own.",
        until="upstream compiles fewer sampling shapes.",
    ),
    Patch(
        slug="sampling-rows",
        module="ranks, engine",
        what="When a batch's rows are short (prompt bucket and new tokens within 128), a call of more rows than "
             "`sample_max_num_sequences` (8 in a run) runs in batches of 4 times that many, and every call that "
             "asks for prompt logprobs (an evaluation's greedy samples), however few its rows, in batches of 2 "
             "times (`ranks.EVALUATION_ROWS_FACTOR`: an evaluation's sampling is where a rank's memory peaks, "
             "and 16 rows of SmolLM2 hold ~100 MB less than 32), so that a run compiles one such program, its "
             "readiness sample's. The engine takes 4 times as many rows of short requests into one call "
             "(`full-sampling-batches`). The nightly RL step's 32 samples on SmolLM2 take 2.5 s instead of 5.0 s "
             "in one process; the demo's 32 greedy evaluation samples (one request each) are one call of 2 "
             "batches instead of 4 calls. The same greedy tokens.",
        why="Upstream samples in batches of `sample_max_num_sequences` rows, each padded to that many, and takes "
            "at most that many requests into a batch; on a CPU a decoding step of 32 rows costs about twice one "
            "of 8 (half as much per row).",
        until="upstream sizes its sampling batches to the call.",
    ),
    Patch(
        slug="adapter-state-program",
        module="checkpoint_io",
        what="One program slices an adapter's weights and optimizer state out of the slot-stacked arrays, and one "
             "puts them back, for every slot (the slot a traced argument).",
        why="Upstream's `extract_adapter_state` and `insert_adapter_state` are compiled per slot index "
            "(`static_argnames`): each save or restore in a slot the process had not used traced and compiled "
            "again (3-8 s for SmolLM2).",
        until="upstream passes the adapter index as an array.",
    ),
    Patch(
        slug="optimizer-own-slot",
        module="ranks",
        what="A model's optimizer holds Adam's moments of its own adapter slot only (upstream's optimizer over a "
             "one-slot view of the LoRA weights), and its step reads and writes that slot alone; every other slot "
             "keeps its weights bit for bit. The checkpoint's optimizer state is the slice it was upstream.",
        why="Upstream's `nnx.Optimizer` of each model covers the LoRA weights of every slot: AdamW's weight decay "
            "applies to all it covers, so one run's `optim_step` with `weight_decay > 0` shrank every other run's "
            "adapter on the cluster; and each model held two moments of every slot (k models on S slots: 2kS "
            "slots of moments, all but k of them zeros), which its step read and wrote.",
        until="upstream's optimizer covers the model's own slot only.",
    ),
    Patch(
        slug="fresh-slot-gradient",
        module="ranks",
        what="A new model's slot starts with no gradient: `create_model` zeroes the slot's gradient sum and count "
             "when its last model left some (tests/test_fresh_slot_gradient.py, and on the shared cluster "
             "tests/test_shared_cluster_e2e.py).",
        why="Upstream's `delete_model` clears the slot's LoRA weights but not its accumulated gradient. A model "
            "unloaded between its forward_backward and its optimizer step (a run killed or cancelled mid-step, a "
            "client that stops) left its gradient there, and the slot's next model, another run's, took it into "
            "its first optimizer step: that run trained on its neighbour's data, and its figures depended on "
            "which slot it got.",
        until="upstream resets a slot's accumulated gradient when it creates or deletes a model.",
    ),
    Patch(
        slug="optimizer-flat-call",
        module="ranks",
        what="A model's optimizer step (`optimizer-own-slot`) is one `jax.jit` program over lists of arrays "
             "(`ranks.flat_optimizer_step`): the LoRA weights, gradient sums and the optimizer's state go in as "
             "arrays, and what comes out is written into the same variables. The same bits as the step under "
             "nnx.jit (tests/test_checkpoint_io.py). SmolLM2, 8 slots, in one process: 0.150 -> 0.108-0.111 s a "
             "step, and the process's peak RSS 4.41-4.44 -> 4.13-4.16 GB.",
        why="Upstream jits the step with `nnx.jit`, which takes the weights, gradients and optimizer through "
            "flax's graph on the way in and out at every call (1,688 variables on SmolLM2): about 0.1 s of "
            "Python against a program of a few hundredths of a second.",
        until="upstream's step is a plain jitted function of arrays.",
    ),
    Patch(
        slug="optimizer-layer-by-layer",
        module="ranks",
        what="A model's jitted optimizer step (`optimizer-flat-call`) runs as one program per five decoder "
             "layers, the same program for every such group, and one for the weights outside the layers "
             "(`ranks.layer_by_layer_step`): each takes its layers' LoRA weights and gradient sums and the "
             "optimizer's state cut to them (Adam's moments of those weights, the shared step count and "
             "hyperparameters). The same bits as the step in one program (tests/test_checkpoint_io.py).",
        why="Adam's arithmetic comes to dozens of XLA instructions a weight, and XLA's CPU runtime holds KBs of "
            "code for each: one program over SmolLM2's 422 weights and 844 moments held ~250 MB in every rank, "
            "and took 3-4 s to load from the persistent cache at a rank's first step. Five layers' program holds "
            "a sixth of it, loaded once and called six times a step.",
        until="upstream's optimizer steps stacked layers, or XLA's CPU runtime holds much less code a program.",
    ),
    Patch(
        slug="one-slot-gradient",
        module="ranks",
        what="A forward_backward whose rows all train one model runs on that model's slot alone: its LoRA "
             "weights, scales and accumulated gradient are taken out as a one-slot view, upstream's program (or "
             "the packed one) runs on the view, and the slot's gradient sum is written back; the counts are "
             "upstream's. A batch of several models keeps upstream's program (the engine forms none since "
             "`one-adapter-batches`). The same logprobs, losses, "
             "gradients and counts (tests/test_one_slot_gradient.py). A sampling batch of one adapter samples from "
             "its slot's view the same way (the same tokens and logprobs), and so does a forward of one model's "
             "rows, which then hands back the accumulated gradients it was given (upstream's forward program "
             "returns a copy of every slot's: 182 MB on SmolLM2's 8 slots; its buffers 385 -> 252 MB). SmolLM2 in "
             "one process: the pass's "
             "transient 1.83 -> 1.34 GB with 8 slots, 3.77 -> 1.22 GB with 32; the SFT step's forward_backward "
             "1.66 -> 1.36 s, the nightly RL step 5.13 -> 4.41 s; the demo's engine peak 5.6 -> 4.8-5.1 GB.",
        why="Upstream differentiates every slot's LoRA weights in every forward_backward: the program stacks "
            "all slots' weights by layer, carries a gradient of each through the backward (zeros but for the "
            "batch's own) and adds them all to the accumulator, so a pass's memory grew with the slots a cluster "
            "holds, not with what it trains (SmolLM2 with 8 slots: 2.38 GB of buffers in the program, 1.60 GB "
            "on one slot). Its sampling programs stack every slot's weights the same way.",
        until="upstream differentiates the batch's own adapters only.",
    ),
    Patch(
        slug="freed-memory-returned",
        module="ranks",
        what="After each request of an evaluation or a checkpoint (create, forward, sample, save, load, delete; "
             "`ranks.RETURNS_FREED_MEMORY`) every rank returns the memory glibc holds free to the system "
             "(`malloc_trim`); a training step's forward_backward and optim_step do not, which would cost each "
             "step 5-20 ms and its pages faulted back in (tests/test_freed_memory_returned.py). The demo's engine "
             "peak 3.66-3.69 -> 3.35-3.37 GB.",
        why="glibc keeps what a program frees below its mmap threshold, which grows to 32 MB as larger blocks are "
            "freed: most of XLA's buffers. A SmolLM2 rank kept 300-500 MB free so after training and its live "
            "reference, and the demo's peak, the restore check's sampling, came on top of them.",
        until="XLA's CPU runtime returns its buffers to the system (or a rank runs under another allocator).",
    ),
    Patch(
        slug="rank-imports",
        module="ranks",
        what="A rank tells transformers there is no torch (`USE_TORCH=0`, unless set) and imports peft only at its "
             "first use, which a rank does not reach: its sampler saves write their config without peft "
             "(`adapter-config-without-peft`).",
        why="Upstream's backend imports transformers (which imports torch when it is installed) for configs and "
            "tokenizers, and peft (which imports torch) for one config file: 9 s of a rank's start on 2 cores, "
            "6.5 of them for code the JAX engine never runs.",
        until="upstream imports peft where it writes the config.",
    ),
    Patch(
        slug="adapter-config-without-peft",
        module="ranks",
        what="A sampler save writes its `adapter_config.json` with `ranks.AdapterConfig`: the file peft's "
             "`LoraConfig(...).save_pretrained` writes, byte for byte, for the peft the project pins "
             "(`ranks.PEFT_LORA_CONFIG`, held to peft's own file by tests/test_rank_imports.py), without importing "
             "peft. A SmolLM2 rank keeps ~194 MB less from its first sampler save on; the demo's engine peak "
             "3.24-3.26 -> 3.03-3.04 GB, and a sampler save takes 0.1 s instead of 1.0-1.25 s.",
        why="Upstream's sampler save builds peft's `LoraConfig` for that one file: the import of peft, which "
            "imports torch, stayed in the rank for the rest of its life (216 MB resident in a bare process).",
        until="upstream writes the adapter config without peft.",
    ),
    Patch(
        slug="base-weights-not-drawn",
        module="models, ranks, reference",
        what="The engine and the export's reference build the model with zeros where upstream draws random "
             "kernels, embeddings and norms, then load the base weights over them as before "
             "(`models.base_weights_not_drawn`); the LoRA factors' initialisers and every key split are upstream's.",
        why="Upstream draws every base weight at random and its loader then replaces each one (or fails on a "
            "missing key): on SmolLM2 the draws took 1-1.6 s of every engine start and export, for values nothing "
            "read (tests/test_base_weights.py holds the built engine's state equal to upstream's).",
        until="upstream builds the model abstractly before it loads a checkpoint.",
    ),
    Patch(
        slug="base-layers-stacked",
        module="models, ranks",
        what="Right after the engine loads the base weights, its decoder stack holds the layers' frozen weights "
             "(every weight but the LoRA factors and their per-slot ranks and scales) stacked by layer, in the "
             "dtype the scan computes in (float32 for a bfloat16 model on a CPU), as variables of its own that "
             "every program takes with the base weights (`models.stack_base_layers`). The scanned layers read them "
             "and stack only the LoRA weights per call. The same figures (tests/test_stacked_base.py).",
        why="Every call of a scanned program stacked and widened each layer's weights anew: on SmolLM2 about 0.4 GB "
            "written per forward_backward and per sampling batch, a tenth of the step's time.",
        until="upstream scans its layers over weights it holds stacked.",
    ),
    Patch(
        slug="widened-layers-keep-their-dots",
        module="models",
        what="Where a bfloat16 model's layers run widened under the scan (`scan-in-float32-on-cpu`), each layer "
             "keeps its projections' outputs for the backward and computes the rest again there (norms, "
             "activations, the rotary embedding, attention's scores and weights: `jax.checkpoint` with "
             "`dots_with_no_batch_dims_saveable`). Its figures move by float32 rounding, far below the bfloat16 "
             "rounding the widening already changes; a float32 model's layers are untouched "
             "(tests/test_scanned_layers.py).",
        why="Every residual the scan saves is a buffer of all the layers that XLA zero-fills before the loop and "
            "copies into it: on SmolLM2 about 0.5 GB per forward_backward, 8% of its time.",
        until="XLA's CPU runtime allocates a loop's saved outputs without filling them.",
    ),
    Patch(
        slug="tied-head-lora",
        module="models, lora_config",
        what="The head applies the embedding's LoRA (`tied_head`: the one shared matrix `E + s A B` at both "
             "ends) and the check is passed by.",
        why="Upstream's tied output head (`LoRAEmbed.T`) drops the adapter and its `init_lora_adapter` refuses "
            "`train_unembed` on a tied model, the Tinker SDK's default.",
        until="upstream applies LoRA to a tied head.",
    ),
    Patch(
        slug="served-names",
        module="served",
        what="The cluster lists and accepts the model's Hugging Face id, txflow's name and its path, refuses any "
             "other name in one line, and answers the loaded directory as the tokenizer (`tokenizer_id`, the "
             "sampler's base model).",
        why="Upstream lists its model by the path it loaded and stores any `base_model` a client sends; a client "
            "written for another server passes the Hugging Face id and loads the tokenizer by the name the "
            "server answers, which needs the network.",
        until="upstream serves aliases.",
    ),
    Patch(
        slug="prefill-once-per-prompt",
        module="models",
        what="The program prefills the batch's distinct (prompt, adapter) rows, padded to a power of two, and "
             "hands each row its prompt's hidden states and KV cache; decoding stays per row "
             "(tests/test_prefill_once.py). An 8-row batch of two RL groups of SmolLM2 at 96 tokens: 1.8 s "
             "instead of 2.9 s. Batches that ask for prompt logprobs (every evaluation of txflow, whose restore "
             "check compares two samplers exactly) keep upstream's program: a shorter prefill rounds differently "
             "in bfloat16.",
        why="A request for `num_samples` completions (an RL group) is that many rows of a sampling batch, and "
            "upstream's program prefilled each.",
        until="upstream shares a request's prefill across its samples.",
    ),
    Patch(
        slug="prompt-logprobs-in-chunks",
        module="models",
        what="A sampling batch that asks for prompt logprobs computes the last position's logits from its hidden "
             "state alone and the prompt's logprobs 128 positions at a time, with the model's own chunked "
             "logprobs (as training computes them); the same figures up to float32 rounding "
             "(tests/test_prompt_logprobs_in_chunks.py). So an evaluation's batch can have `sampling-rows`' "
             "larger row count without multiplying its memory.",
        why="Upstream's program computes the output head at every position of every row and keeps those logits "
            "(rows x prompt x vocabulary in float32: 100 MB for 8 rows of 64 tokens of SmolLM2, in several "
            "copies) to take the last position's and each next token's logprob from them.",
        until="upstream computes prompt logprobs in chunks.",
    ),
    Patch(
        slug="no-forward-after-the-last-token",
        module="models",
        what="The sampling program (`models.prefill_and_decode`, upstream's code but for its loop's end) decodes "
             "one step fewer and samples the last token after the loop, from the logits its last step computed, "
             "with the same keys: the same tokens, logprobs and stop positions "
             "(tests/test_no_forward_after_the_last_token.py). The prefill-once and prompt-logprobs programs "
             "run it too.",
        why="Upstream's decoding loop runs the model after every token it samples, the last one included, for "
            "logits nothing reads: one of the 4 decoding passes of the nightly's RL batches, one of 8 of an "
            "evaluation's.",
        until="upstream's loop stops after its last token.",
    ),
    Patch(
        slug="one-draw-per-token",
        module="models",
        what="The sampling program (`models.prefill_and_decode`) draws a step's tokens only the way its batch "
             "needs: greedy rows alone take the argmax, sampled rows alone the categorical draw, and a batch of "
             "both kinds runs both, as upstream; each row's token is the one upstream's `where` keeps "
             "(tests/test_no_forward_after_the_last_token.py counts the draws that run).",
        why="Upstream draws every row's token both ways at every step and keeps one per row. A categorical draw "
            "over SmolLM2's 49,152 logits a row (its noise, then an argmax) is not free on a CPU: an evaluation's "
            "32 greedy rows of 8 tokens sampled in 2.26-2.33 s instead of 2.47-2.48 s.",
        until="upstream draws only the tokens its rows keep.",
    ),
    Patch(
        slug="packed-prefixes",
        module="packing",
        what="A forward_backward or forward micro-batch whose rows share prefixes (the same tokens for the same "
             "adapter: a few-shot turn every prompt starts with, an RL group's prompt) runs packed when that halves "
             "the tokens it computes: its rows as a prefix tree in one row, every token they share at the same "
             "depth once, each at its position in its row, under a mask by which a token sees its own row's "
             "earlier tokens only; the output head runs once per distinct (packed position, target), each row's "
             "logprobs are gathered back and upstream's losses and gradients computed on them (same figures in "
             "float32, tests/test_packing.py). A batch of more rows than `train_micro_batch_size` is one "
             "micro-batch when packed it computes no more than one of upstream's. The nightly's RL "
             "forward_backward on SmolLM2 (8 prompts of 73-74 tokens, 54 of them shared, x 4 samples; one row of "
             "384 instead of 32 of 96, the head at 384 positions instead of 3072), in one process: 2.6 s instead of "
             "14.6 s. Rows that open with the same chat template are packed too (the demo's SFT batch, 4 rows of "
             "~52 tokens: one row of 128). Other batches, and engines of several processes or devices, keep "
             "upstream's program.",
        why="Upstream computes every row of a batch whole, so an RL step computed each prompt once per sample "
            "(three quarters of the nightly's forward_backward).",
        until="upstream shares a prompt's computation across its samples in training.",
    ),
)

BY_SLUG: dict[str, Patch] = {patch.slug: patch for patch in PATCHES}
