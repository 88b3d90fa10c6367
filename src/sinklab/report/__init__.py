"""``sinklab report``: run probe, stream and ablate on one model; write one self-contained page.

Public API: :func:`build_report` (run stages, write ``DIR/index.html`` + ``DIR/results.json``
atomically), :func:`build_into` (the same into a folder its caller places),
:class:`ReportConfig` (sizes; :meth:`ReportConfig.preset` for full / quick), :func:`all_stages` /
:func:`select_stages` (the stage catalog), :class:`Stage` and :class:`StageOutput` (to add a
stage), :func:`check_out_dir`.
"""

from sinklab.report.build import Report, build_into, build_report, check_out_dir
from sinklab.report.catalog import all_stages, select_stages
from sinklab.report.cells import Cell, FigureSpec, TableSpec
from sinklab.report.config import ReportConfig
from sinklab.report.stages import Stage, StageContext, StageOutput, StageResult

__all__ = [
    "Cell",
    "FigureSpec",
    "Report",
    "ReportConfig",
    "Stage",
    "StageContext",
    "StageOutput",
    "StageResult",
    "TableSpec",
    "all_stages",
    "build_into",
    "build_report",
    "check_out_dir",
    "select_stages",
]
