"""Exit codes and the errors that map to them.

CI reads the exit code to tell a kernel regression (1) from a broken machine (3) from a bad
config (4) from a run that judged less than its configs ask (6), so every failure path raises one of
these instead of a bare exception.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    GATE_FAILED = 1  # an accuracy gate failed: the kernel (or model) regressed
    INFRA = 3  # server start/crash, request errors, timeouts: the run proves nothing
    CONFIG = 4  # bad config, list or command-line usage
    NOTHING_SELECTED = 5  # the selection (hardware list, shard) holds no config
    GATE_NOT_RUN = 6  # a gate a config calls for could not run, not declared optional: judged less


class MoeEvalError(Exception):
    exit_code: ExitCode = ExitCode.INFRA


class ConfigError(MoeEvalError):
    """A config file, hardware list or command-line value is wrong; names file, key and value."""

    exit_code = ExitCode.CONFIG


class NothingSelected(MoeEvalError):
    exit_code = ExitCode.NOTHING_SELECTED


class InfraError(MoeEvalError):
    """The infrastructure failed (server, requests, timeouts): not an accuracy verdict."""

    exit_code = ExitCode.INFRA
