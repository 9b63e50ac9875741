"""The Kubernetes manifests (deploy/k8s/) against the code: every container runs one of our CLIs
with arguments its parser accepts; the dmlc variables agree with each other and with the
replica counts, the Services and the ports; the job config in the ConfigMap loads; and each
pod's Secret items give exactly the keys its role needs (checked with the roles' own key
checks on files laid out as the pods would see them). No cluster is needed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from ps_common.config import load_config
from ps_common.dmlc import read_dmlc_env
from ps_common.security.keys import SecurityError
from ps_common.security.settings import init_local_keys
from ps_server.cli import build_parser as server_parser
from ps_worker.cli import build_parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
PARSERS = {"ps-server": server_parser, "ps-worker": worker_parser}


def kind(k: str) -> list[dict]:
    return [d for d in DOCS if d["kind"] == k]


def workloads() -> list[dict]:
    return kind("StatefulSet") + kind("Job")


def env_of(container: dict) -> dict[str, str]:
    out = {}
    for e in container.get("env", []):
        out[e["name"]] = e.get("value", "10.0.0.7")   # fieldRef (the pod IP): any address
    return out


def test_every_container_runs_a_cli_with_arguments_it_accepts():
    assert len(workloads()) == 3
    for w in workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            (cli,) = c["command"]
            assert cli in PARSERS, f"{w['metadata']['name']}: {cli} is not one of our commands"
            PARSERS[cli]().parse_args(c["args"])       # exits (SystemExit) on an unknown flag


def test_dmlc_variables_agree_with_replicas_services_and_ports():
    by_role = {}
    for w in workloads():
        (c,) = w["spec"]["template"]["spec"]["containers"]
        d = read_dmlc_env(env_of(c))
        by_role[d.role] = (w, c, d)
    assert set(by_role) == {"scheduler", "server", "worker"}
    envs = [d for _, _, d in by_role.values()]
    assert len({(d.root_uri, d.root_port, d.num_server, d.num_worker) for d in envs}) == 1
    sched, sc, d = by_role["scheduler"]
    assert sched["spec"]["replicas"] == 1
    # The root URI is the scheduler pod's stable name behind its headless Service.
    svc = next(s for s in kind("Service") if s["metadata"]["name"] == sched["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert d.root_uri == f"{sched['metadata']['name']}-0.{svc['metadata']['name']}"
    labels = sched["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert d.root_port in [p["port"] for p in svc["spec"]["ports"]]
    assert d.root_port in [p["containerPort"] for p in sc["ports"]]
    assert by_role["server"][0]["spec"]["replicas"] == d.num_server
    job = by_role["worker"][0]["spec"]
    assert job["completions"] == job["parallelism"] == d.num_worker
    assert "DMLC_NODE_HOST" in env_of(by_role["server"][1]), "servers advertise their pod IP"
    server = by_role["server"][1]
    assert server["args"][server["args"].index("--name") + 1] == "$(POD_NAME)", "claims by the pod's stable name"
    assert any(e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
               for e in server["env"])


def test_the_job_config_loads_and_each_pod_holds_the_keys_its_role_needs(tmp_path):
    (cm,) = kind("ConfigMap")
    cfg_path = tmp_path / "job.yaml"
    cfg_path.write_text(cm["data"]["job.yaml"])
    cfg = load_config(cfg_path, env={})
    assert cfg.security.curve
    made = tmp_path / "made"
    init_local_keys(made)                              # what the README says to run: ps-keys init keys/
    secret_files = {  # the Secrets' keys, made with kubectl --from-file as the manifest's header says
        "server.key_secret": made / "server.key_secret", "server.key": made / "server.key",
        "allowed-worker.key": made / "allowed" / "worker.key",
        "allowed-operator.key": made / "allowed" / "operator.key",
        "worker.key_secret": made / "worker.key_secret"}
    for w in workloads():
        spec = w["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        role = read_dmlc_env(env_of(c)).role
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "keys"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "keys"]
        pod = tmp_path / w["metadata"]["name"]
        for item in vol["secret"]["items"]:
            dest = pod / item["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(secret_files[item["key"]], dest)
        sec = cfg.security.model_copy(update={
            k: str(pod / Path(v).relative_to(mount["mountPath"]))
            for k, v in cfg.security.model_dump().items() if isinstance(v, str) and v.startswith(mount["mountPath"])})
        if role == "worker":
            sec.require_client("worker")
            with pytest.raises(SecurityError):
                sec.require_server()                   # a worker pod holds no server secret
        else:
            sec.require_server()
            sec.require_client("shard")                # followers dial shard 0 as a shard


def test_shards_keep_their_run_directories_and_checkpoints_across_restarts(tmp_path):
    """A shard pod's run directory (with its checkpoints) is on a volume claimed per pod, and the
    pod's one command resumes from it when it holds a checkpoint: a restarted pod goes on."""
    (cm,) = kind("ConfigMap")
    cfg_path = tmp_path / "job.yaml"
    cfg_path.write_text(cm["data"]["job.yaml"])
    cfg = load_config(cfg_path, env={})
    assert cfg.checkpoint.every_iterations and cfg.checkpoint.dir is None, "checkpoints in the run directory"
    for sts in kind("StatefulSet"):
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        args = server_parser().parse_args(c["args"])
        assert args.resume == "auto", sts["metadata"]["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "runs"]
        assert Path(args.run_dir).is_relative_to(mount["mountPath"])
        claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
        assert "runs" in claims, "a PersistentVolumeClaim per pod, not an emptyDir"
        assert all(v["name"] != "runs" for v in sts["spec"]["template"]["spec"]["volumes"])
