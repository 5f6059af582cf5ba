"""Shared test setup. Device tests (marker ``device``) need a real RDMA device; when the
environment says one is required (PYRDMA_REQUIRE_DEVICE=1, set by scripts/test.sh inside the VM),
a missing device fails those tests instead of skipping them."""
import os

import pytest

REQUIRE_DEVICE = os.environ.get("PYRDMA_REQUIRE_DEVICE") == "1"


def _device_available():
    try:
        import pyrdma
        with pyrdma.Context():
            return True, ""
    except Exception as exc:   # no device, no driver, no build: say why
        return False, f"no usable RDMA device: {exc}"


def pytest_collection_modifyitems(config, items):
    device_items = [item for item in items if item.get_closest_marker("device")]
    if not device_items:
        return
    ok, why = _device_available()
    if ok:
        return
    for item in device_items:
        if REQUIRE_DEVICE:
            item.fixturenames.append("_require_device_failure")
        else:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def _require_device_failure():
    pytest.fail(f"PYRDMA_REQUIRE_DEVICE=1 but {_device_available()[1]}")
