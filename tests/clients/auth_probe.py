"""A custom client that probes the cluster's Tinker API as an outsider would and as the run's own client does.

Without the key, with a wrong one, and with the run's key (TINKER_API_KEY, as txflow hands it to its
client): one state-changing route (create_session, save_weights_for_sampler) and one reading route
(training_runs), raw HTTP; then the Tinker SDK with a wrong key and with the right one, which saves a
sampler checkpoint for the run to verify, and asks for its archive URL: fetched with no key as it is, with
its signature altered, and without its signature. With STATE_DIR, it also records the mode of every file and
folder there while the cluster runs (SQLite's WAL and SHM files exist only then). Prints one JSON line of
status codes and outcomes.

Usage: python auth_probe.py BASE_MODEL [STATE_DIR]
"""

import json
import os
import stat
import sys
from pathlib import Path

import httpx
import tinker

BASE, KEY = os.environ["TINKER_BASE_URL"], os.environ["TINKER_API_KEY"]
KEYS = {"no key": {}, "wrong key": {"X-API-Key": "tml-wrong-key"}, "the run's key": {"X-API-Key": KEY},
        "bearer": {"Authorization": f"Bearer {KEY}"}}


def status(method: str, path: str, headers: dict, body: dict | None = None) -> int:
    return httpx.request(method, BASE + path, headers=headers, json=body, timeout=60).status_code


def main() -> None:
    found = {"healthz": status("GET", "/api/v1/healthz", {})}
    refused = httpx.post(BASE + "/api/v1/create_session", json={}, timeout=60)
    found["refusal"] = refused.text
    session = {"tags": [], "user_metadata": None, "sdk_version": tinker.__version__}
    for name, headers in KEYS.items():
        found[f"create_session, {name}"] = status("POST", "/api/v1/create_session", headers, session)
        found[f"training_runs, {name}"] = status("GET", "/api/v1/training_runs", headers)
    # The SDK's X-API-Key comes from TINKER_API_KEY when it is set (0.13 lets it override api_key=), so
    # the outsider's SDK gets the wrong key both ways.
    os.environ["TINKER_API_KEY"] = "tml-wrong-key"
    try:
        tinker.ServiceClient(base_url=BASE, api_key="tml-wrong-key").create_lora_training_client(
            base_model=sys.argv[1], rank=8)
        found["sdk, wrong key"] = "accepted"
    except Exception as exc:  # what the SDK raises when the cluster refuses it
        found["sdk, wrong key"] = type(exc).__name__
    finally:
        os.environ["TINKER_API_KEY"] = KEY
    training = tinker.ServiceClient(base_url=BASE).create_lora_training_client(base_model=sys.argv[1],
                                                                               rank=8, train_unembed=False)
    save = {"model_id": training.model_id, "path": "probe", "type": "save_weights_for_sampler"}
    for name, headers in KEYS.items():
        if name != "the run's key":
            found[f"save_weights_for_sampler, {name}"] = status("POST", "/api/v1/save_weights_for_sampler",
                                                                headers, save)
    found["sdk, the run's key"] = sampler = training.save_weights_for_sampler("probe-sampler").result().path
    url = tinker.ServiceClient(base_url=BASE).create_rest_client().get_checkpoint_archive_url_from_tinker_path(
        sampler).result().url
    tampered = url[:-1] + ("0" if url[-1] != "0" else "1")  # the signature's last hex digit
    for name, download in {"signed": url, "tampered": tampered, "unsigned": url.split("?")[0]}.items():
        found[f"{name} download, no key"] = httpx.get(download, timeout=60).status_code
    if len(sys.argv) > 2:
        top = Path(sys.argv[2])
        found["live modes"] = {str(p.relative_to(top)): oct(stat.S_IMODE(p.lstat().st_mode))
                               for p in [top, *top.rglob("*")] if not p.is_symlink()}
    print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
