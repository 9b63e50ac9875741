"""Configuration: examples load; unknown keys and bad values name the key; override order."""

from __future__ import annotations

from pathlib import Path

import pytest

from ps_common.config import ConfigError, JobConfig, load_config
from ps_server.job_config import check_job_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_example_config_loads(path):
    if "compare:" in path.read_text():
        from ps_launcher.compare import load_comparison

        cfg, comp = load_comparison(path)
        assert comp.repeats >= 1 and len(comp.modes) >= 2
    else:
        cfg = load_config(path, env={}, check=check_job_config)
    assert isinstance(cfg, JobConfig)
    assert cfg.training.global_batch >= cfg.cluster.num_workers * cfg.training.min_batch
    assert any(v is not None for v in (cfg.training.max_iterations, cfg.training.epochs,
                                       cfg.training.max_seconds, cfg.training.target_accuracy))


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"training\.global_bach: unknown key"):
        load_config(write(tmp_path, "training: {global_bach: 5}"), env={})


def test_bad_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"training\.global_batch: .*greater than 0"):
        load_config(write(tmp_path, "training: {global_batch: -1}"), env={})


def test_enum_errors_list_allowed_values(tmp_path):
    # Models, sync modes and batch policies are registered above ps_common: the servers' loader checks them.
    known = "asp, backup, bsp, flexrr, ssp"
    with pytest.raises(ConfigError, match=rf"mode\.sync: unknown sync policy 'bogus'; known: {known}"):
        load_config(write(tmp_path, "mode: {sync: bogus}"), env={}, check=check_job_config)
    with pytest.raises(ConfigError, match=r"model\.name: unknown model 'resnet999'; known: .*lenet"):
        load_config(write(tmp_path, "model: {name: resnet999}"), env={}, check=check_job_config)
    with pytest.raises(ConfigError, match=r"mode\.batch_policy: .*known: .*uniform"):
        load_config(write(tmp_path, "mode: {batch_policy: magic}"), env={}, check=check_job_config)


def test_a_mode_checks_its_own_settings_at_load(tmp_path):
    text = "cluster: {num_workers: 3}\nmode: {sync: backup, backup_workers: 3}"
    with pytest.raises(ConfigError, match=r"c\.yaml.*\n  mode\.backup_workers \(3\) must be below "
                                          r"cluster\.num_workers \(3\)"):
        load_config(write(tmp_path, text), env={}, check=check_job_config)
    assert load_config(write(tmp_path, text.replace("backup_workers: 3", "backup_workers: 2")), env={},
                       check=check_job_config).mode.backup_workers == 2


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1,"), env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", env={})
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2"), env={})


def test_override_precedence_yaml_env_cli(tmp_path):
    p = write(tmp_path, "training: {global_batch: 100, max_iterations: 5}")
    assert load_config(p, env={}).training.global_batch == 100
    env = {"LBBSP__TRAINING__GLOBAL_BATCH": "200"}
    assert load_config(p, env=env).training.global_batch == 200
    cfg = load_config(p, ["training.global_batch=300"], env=env)
    assert cfg.training.global_batch == 300 and cfg.training.max_iterations == 5
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(p, ["training.global_batch"], env={})


def test_config_is_frozen_and_digest_tracks_job_settings():
    a = load_config(None, env={})
    with pytest.raises(ValueError, match="frozen"):
        a.training.global_batch = 5  # type: ignore[misc]
    b = a.with_overrides(["worker.torch_threads=2"])
    c = a.with_overrides(["optimizer.lr=0.5"])
    assert a.job_digest() == b.job_digest(), "worker-local settings are not part of the job"
    assert a.job_digest() != c.job_digest()


def test_key_paths_in_a_config_file_name_files_beside_it(tmp_path, monkeypatch):
    d = tmp_path / "job"
    d.mkdir()
    (d / "job.yaml").write_text("security: {curve: true, server_public_key: keys/server.key, "
                                "client_keys_dir: keys, allowed_clients_dir: /etc/lbbsp/allowed}\n")
    monkeypatch.chdir(tmp_path)                      # started from elsewhere
    cfg = load_config(d / "job.yaml", env={})
    assert cfg.security.server_public_key == str(d / "keys" / "server.key")
    assert cfg.security.client_keys_dir == str(d / "keys")
    assert cfg.security.allowed_clients_dir == "/etc/lbbsp/allowed"
    typed = load_config(d / "job.yaml", ["security.client_keys_dir=mine"], env={})
    assert typed.security.client_keys_dir == "mine", "a path typed on the command line stays as typed"


def test_the_launchers_list_of_built_in_models_is_the_registrys():
    """ps-launch checks built-in model names without importing torch; the list must be exactly
    what ps_ml.models registers (a new model there must be added to it)."""
    import re
    from pathlib import Path

    import ps_ml.models as models
    from ps_server.job_config import BUILTIN_MODELS

    source = Path(models.__file__).read_text()
    assert set(re.findall(r'@register_model\("(\w+)"\)', source)) == BUILTIN_MODELS
    assert BUILTIN_MODELS <= set(models.MODEL_REGISTRY.names())
