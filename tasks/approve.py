"""With `approve`, between the checks and promote: a person approves or rejects the run in the Prefect
UI, which shows its figures. Not a Prefect task: a flow run pauses, and only from the flow itself.

It runs after teardown (and after the concurrency slots are given back): no process of the cluster
waits on a person, only the flow run's own. A wait that times out ends the run passed and not
promoted; the flow run is set running again first, since Prefect fails a run that finishes while
paused ("never resumed")."""

from __future__ import annotations

from prefect.exceptions import FlowPauseTimeout
from prefect.input import RunInput
from pydantic import Field

from txflow.artifacts import promote
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.results import Decision


class Approval(RunInput):
    """What the UI asks for, and what `resume_flow_run(..., run_input=...)` gives."""

    approve: bool = Field(default=False, description="Promote this run")
    comment: str = Field(default="", description="Why (kept in promotion.json and the report)")
    approver: str = Field(default="", description="Your name (kept in promotion.json and the report: the Prefect "
                                                  "server records no user)")


def approval(cfg: RunConfig, summary: str) -> Decision:
    """The person's answer, its comment and who gave it; "not approved in time" when nobody answered."""
    from prefect.flow_runs import pause_flow_run

    log = get_logger()
    log.info(f"waiting up to {cfg.export.approve_timeout_s:g} s for a person to approve promoting run {cfg.run_id} as "
             f"{cfg.export.promote_as!r} (Prefect UI: the flow run's Resume button)")
    poll_s = int(min(10, max(1, cfg.export.approve_timeout_s // 10)))
    try:
        answer = pause_flow_run(wait_for_input=Approval.with_initial_data(description=summary, approve=False),
                                timeout=int(cfg.export.approve_timeout_s), poll_interval=poll_s)
    except FlowPauseTimeout:
        _running_again("no approval in time: not promoted")
        log.warning(f"no approval within {cfg.export.approve_timeout_s:g} s: run {cfg.run_id} is not promoted")
        return Decision(verdict="not approved in time")
    verdict = "approved" if answer.approve else "rejected"
    approver = promote.approver(promote.answer_sender(answer.metadata.receiver, answer.metadata.key),
                                  answer.approver)
    log.info(f"run {cfg.run_id} {verdict} for promotion as {cfg.export.promote_as!r} by {approver}"
             + (f": {answer.comment}" if answer.comment else ""))
    return Decision(verdict=verdict, comment=answer.comment or None, approver=approver)


def _running_again(message: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext
    from prefect.states import Running

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(FlowRunContext.get().flow_run.id, Running(message=message), force=True)
