"""Check JUnit XML reports: ``python -m pyrdma.testing.junit HOST.xml DEVICE.xml``.

Prints one summary line per report and exits non-zero if a report is missing or unreadable,
any test failed or errored, the device report ran no test, or any device test was skipped
(a skipped device test means the device path went untested).
"""
import sys
import xml.etree.ElementTree as ET


def summarize(path):
    """(tests, failures, errors, skipped, skipped_names) of a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failures = errors = skipped = 0
    names = []
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failures += int(suite.get("failures", 0))
        errors += int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
        for case in suite.iter("testcase"):
            if case.find("skipped") is not None:
                names.append(f"{case.get('classname')}::{case.get('name')}")
    return tests, failures, errors, skipped, names


def check(host_xml, device_xml):
    problems = []
    for label, path in (("host", host_xml), ("device", device_xml)):
        try:
            tests, failures, errors, skipped, names = summarize(path)
        except (OSError, ET.ParseError) as exc:
            problems.append(f"{label}: no readable report at {path} ({exc})")
            continue
        print(f"{label}: {tests - failures - errors - skipped} passed, {failures + errors} failed, "
              f"{skipped} skipped")
        if failures or errors:
            problems.append(f"{label}: {failures} failed, {errors} errors")
        if label == "device":
            if tests == 0:
                problems.append("device: no device test ran")
            if skipped:
                problems.append(f"device: {skipped} device tests were skipped: {', '.join(names[:10])}")
    for p in problems:
        print("FAIL " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m pyrdma.testing.junit HOST.xml DEVICE.xml")
    sys.exit(check(sys.argv[1], sys.argv[2]))
