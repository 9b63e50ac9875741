"""Argument and logging helpers shared by every command-line tool."""

from __future__ import annotations

import argparse
import logging
import os

from ps_common.config import JobConfig, load_config


def add_common_args(ap: argparse.ArgumentParser, *, config_required: bool = True) -> None:
    ap.add_argument("--config", required=config_required, help="job YAML (see configs/)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set training.global_batch=256")
    ap.add_argument("--run-dir", default=None, help="directory for this process's metrics")
    ap.add_argument("--log-level", default=os.environ.get("LBBSP_LOG_LEVEL", "INFO"))


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")


def load_cli_config(path: str | None, overrides: list[str]) -> JobConfig:
    return load_config(path, overrides)
