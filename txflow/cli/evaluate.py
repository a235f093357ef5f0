"""`txflow eval`: a real harness (Inspect) scores the base model and trained adapters on a task, through the
OpenAI-compatible endpoint `txflow serve` runs, on a warm cluster."""

from __future__ import annotations

import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

from txflow.cli.options import command_storage_options
from txflow.cli.serve import attached
from txflow.log import register_secret, scrub


def eval_cmd(args) -> int:
    """`txflow eval --cluster NAME [--adapter NAME=URL ...] [--task arithmetic|FILE]`: each model's score side by
    side (0); 2 on bad input, before anything is loaded; 1 when the harness's run fails."""
    from txflow.serving import evaluation, models

    try:
        options = command_storage_options(args.storage_option)
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit {args.limit}: at least 1 sample")
        task = evaluation.task_rows(args.task, options)  # a task that cannot be read stops here
        adapters = models.parse_adapters(args.adapter)
        references = models.references(adapters, options)
    except ValueError as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or str(Path(".txflow") / "evals" / time.strftime("%Y%m%d-%H%M%S"))
    api_key = "sk-txflow-" + secrets.token_hex(16)  # the endpoint's, for this process's harness only
    register_secret(api_key)
    with tempfile.TemporaryDirectory(prefix="txflow-eval-") as state:
        serving = attached(args, options, Path(state))
        if serving is None:
            return 2
        try:
            models.load(serving, references)
            with evaluation.endpoint(serving, api_key) as base_url:
                scores = evaluation.run(base_url, api_key, list(serving.models), task, log_dir, args.limit,
                                        args.max_tokens)
        except RuntimeError as exc:
            print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
            return 1
        finally:
            models.release(serving)
    report = evaluation.report(task[0], scores)
    path = evaluation.write(report, log_dir)
    from txflow.checkpoints import export
    from txflow.reporting import tracking

    # Each adapter's run root, where pre-flight found its checked sampler; as the training run recorded it:
    # absolute, when it is a path.
    roots = {name: root if "://" in root else str(Path(root).absolute())
             for name, root in ((name, export.run_root_of(ref.sampler_url)) for name, ref in references.items())}
    tracking.log_eval(tracking.store_uri(args.tracking_uri), report, roots)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(evaluation.table(report), file=sys.stderr)
    print(f"txflow: Inspect's logs in {log_dir} (`inspect view --log-dir {log_dir}`); scores in {path}",
          file=sys.stderr)
    return 0
