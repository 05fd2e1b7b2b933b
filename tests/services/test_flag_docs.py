"""docs/services.md's flag tables are the config classes' own: a new or changed flag must be
documented in the same commit (regenerate with services.config.flags_markdown)."""
from pathlib import Path

import pytest

from services.config import (GatewayConfig, PlannerConfig, SchedulerConfig, ServeConfig, ServiceConfig,
                             TokenizerConfig, WorkerConfig, flags_markdown)
from services.engine_args import ServedEngineArgs, defaults_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "services.md"


@pytest.mark.parametrize("cls, base", [(ServiceConfig, None), (GatewayConfig, ServiceConfig),
                                       (TokenizerConfig, ServiceConfig), (SchedulerConfig, ServiceConfig),
                                       (WorkerConfig, (ServiceConfig, ServedEngineArgs)),
                                       (ServeConfig, ServedEngineArgs), (ServedEngineArgs, None),
                                       (PlannerConfig, None)])
def test_flag_table_is_in_the_docs(cls, base):
    assert flags_markdown(cls, base) in DOC.read_text(encoding="utf-8"), (
        f"docs/services.md's table for {cls.__name__} is stale: paste services.config.flags_markdown"
        f"({cls.__name__}{', ' + base.__name__ if base else ''})")
