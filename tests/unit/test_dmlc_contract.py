"""The dmlc environment contract read from variables alone: what it yields, and errors that name
what is missing or wrong. (A job started from these variables: tests/system/test_system_dmlc.py.)"""

from __future__ import annotations

import pytest

from ps_common.dmlc import DmlcEnvError, read_dmlc_env


def test_the_contract_names_what_is_missing_or_wrong():
    assert read_dmlc_env({}) is None
    full = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9091",
            "DMLC_NUM_SERVER": "4", "DMLC_NUM_WORKER": "8"}
    d = read_dmlc_env(full)
    assert d.coordinator == "tcp://10.0.0.1:9091"
    assert d.overrides() == ["cluster.num_shards=5", "cluster.num_workers=8"]
    assert read_dmlc_env({**full, "DMLC_NODE_HOST": "node7"}).advertise() == "node7"
    for change, text in [({"DMLC_ROLE": "boss"}, "expected one of"), ({"DMLC_PS_ROOT_URI": ""}, "DMLC_PS_ROOT_URI"),
                         ({"DMLC_PS_ROOT_PORT": "x"}, "not an integer"), ({"DMLC_PS_ROOT_PORT": "0"}, ">= 1"),
                         ({"DMLC_NUM_WORKER": "0"}, "DMLC_NUM_WORKER=0")]:
        with pytest.raises(DmlcEnvError, match=text):
            read_dmlc_env({**full, **change})
