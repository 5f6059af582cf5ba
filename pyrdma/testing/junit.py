"""Check pytest's JUnit XML reports: ``python -m pyrdma.testing.junit HOST.xml DEVICE.xml [DEVICE2.xml ...]``
(several device reports, of device runs in separate pytest processes, count as one).

Prints one summary line per report and exits non-zero if a report is missing or unreadable, any
test failed or errored, no device test ran, or any device test was skipped (a skipped device test
means the device path went untested). Expected failures (xfail) are counted apart, not as skips.
"""
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field


@dataclass
class Report:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    xfailed: int = 0
    skipped_names: list = field(default_factory=list)
    failed_names: list = field(default_factory=list)

    @property
    def tests(self):
        return self.passed + self.failed + self.errors + self.skipped + self.xfailed

    def line(self, label):
        extra = f", {self.xfailed} xfailed" if self.xfailed else ""
        return (f"{label}: {self.tests} tests: {self.passed} passed, {self.failed} failed, {self.errors} errors, "
                f"{self.skipped} skipped{extra}")


def summarize(path):
    """A Report of a pytest JUnit XML file, counted from its <testcase> elements."""
    root = ET.parse(path).getroot()
    report = Report()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        skip = case.find("skipped")
        if case.find("failure") is not None:
            report.failed += 1
            report.failed_names.append(name)
        elif case.find("error") is not None:
            report.errors += 1
            report.failed_names.append(name)
        elif skip is not None and skip.get("type") == "pytest.xfail":
            report.xfailed += 1
        elif skip is not None:
            report.skipped += 1
            report.skipped_names.append(f"{name} ({skip.get('message', '')})")
        else:
            report.passed += 1
    return report


def problems(label, report, device):
    """What makes this report a failure (empty list: it passes)."""
    found = []
    if report.failed or report.errors:
        found.append(f"{label}: {report.failed} failed, {report.errors} errors: {', '.join(report.failed_names[:10])}")
    if device and report.tests == 0:
        found.append(f"{label}: no device test ran")
    if device and report.skipped:
        found.append(f"{label}: {report.skipped} device tests were skipped: {'; '.join(report.skipped_names[:10])}")
    return found


def check(host_xml, device_xml, out=sys.stdout):
    """Print a summary of the reports (``device_xml``: one path or a list, summed) and what is wrong
    with them; 0 if nothing is."""
    found = []
    device_paths = [device_xml] if isinstance(device_xml, str) else list(device_xml)
    for label, paths, device in (("host", [host_xml], False), ("device", device_paths, True)):
        report = Report()
        for path in paths:
            try:
                part = summarize(path)
            except (OSError, ET.ParseError) as exc:
                found.append(f"{label}: no readable report at {path} ({exc})")
                continue
            for name in ("passed", "failed", "errors", "skipped", "xfailed"):
                setattr(report, name, getattr(report, name) + getattr(part, name))
            report.skipped_names += part.skipped_names
            report.failed_names += part.failed_names
        print(report.line(label), file=out)
        found += problems(label, report, device)
    for p in found:
        print("FAIL " + p, file=out)
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python -m pyrdma.testing.junit HOST.xml DEVICE.xml [DEVICE2.xml ...]")
    sys.exit(check(sys.argv[1], sys.argv[2:]))
