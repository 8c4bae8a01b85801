"""The chart loaded once and every values variant rendered once, for all the chart's tests."""

from __future__ import annotations

import pytest

from tests.unit.helm.chart import CHART, VARIANTS, helm, render


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def rendered(chart) -> dict[str, list[dict]]:
    return {name: render(chart, values) for name, values in VARIANTS.items()}
