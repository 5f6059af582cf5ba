"""Build pyrdma: Cython wrappers (pyx/) over libibverbs and librdmacm (rdma-core).

The build needs rdma-core's headers (libibverbs-dev, librdmacm-dev: the structs and the inline post/poll
paths of <infiniband/verbs.h>); the modules it makes do not link rdma-core's libraries: they open
libibverbs.so.1 / librdmacm.so.1 at run time (include/pyrdma_dl.c), so a wheel built here installs and
imports where rdma-core is absent, and says what is missing on first use."""
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
VERBS_HEADER = "infiniband/verbs.h"
CM_HEADER = "rdma/rdma_cma.h"
HEADER_DIRS = ["/usr/include", "/usr/local/include"]

# Low-level modules, one per verbs object (cm: rdma_cm; loader: the libraries themselves):
# pyx/<name>.pyx -> pyrdma._verbs.<name>
VERBS_MODULES = ["base", "loader", "device", "pd", "mr", "cq", "wr", "srq", "ah", "mw", "qp", "qpex", "cm"]
# Other compiled modules: pyx/<name>.pyx -> pyrdma.<name>
OTHER_MODULES = {"reduce": "pyrdma._reduce", "engine": "pyrdma._engine", "hostcalls": "pyrdma._hostcalls"}
# Linked into every module: the entry points of libibverbs and librdmacm, opened at run time (a module
# that calls none takes nothing from it). A static library, compiled once: as a source of each
# extension, the parallel build (-j) would write its one object file from several threads.
RUNTIME_LOADER = ("pyrdma_dl", {"sources": ["include/pyrdma_dl.c"], "cflags": ["-O2"],
                                "obj_deps": {"": ["include/pyrdma_dl.h"]}})


def _check_libibverbs():
    # the compiler also searches CPATH / C_INCLUDE_PATH (rdma-core unpacked outside /usr, say)
    extra = [d for var in ("CPATH", "C_INCLUDE_PATH") for d in os.environ.get(var, "").split(os.pathsep) if d]
    found = [h for h in (VERBS_HEADER, CM_HEADER)
             if any(os.path.exists(os.path.join(d, h)) for d in HEADER_DIRS + extra)]
    if found == [VERBS_HEADER, CM_HEADER]:
        return
    if VERBS_HEADER in found:
        sys.exit("pyrdma: cannot find <rdma/rdma_cma.h>. Install the librdmacm development files:\n"
                 "    Debian/Ubuntu: apt-get install librdmacm-dev\n"
                 "    RHEL/Fedora:   dnf install rdma-core-devel")
    sys.exit("pyrdma: cannot find <infiniband/verbs.h>. Install the rdma-core development files:\n"
             "    Debian/Ubuntu: apt-get install libibverbs-dev rdma-core ibverbs-providers\n"
             "    RHEL/Fedora:   dnf install rdma-core-devel")


def _loader_libraries():
    # dlopen/dlvsym and pthread_once are in libc from glibc 2.34 on; before, in libdl and libpthread.
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""     # "glibc 2.36"
    except (ValueError, OSError):
        version = ""
    if version.startswith("glibc ") and tuple(map(int, version.split()[1].split(".")[:2])) < (2, 34):
        return ["dl", "pthread"]
    return []


def _pxd_include_path():
    # Cython resolves `from pyrdma._verbs.x cimport ...` as pyrdma/_verbs/x.pxd on its include path
    # (and `from pyrdma._engine cimport ...` as pyrdma/_engine.pxd); the sources live flat in pyx/,
    # so point package-shaped links at them.
    root = os.path.join(HERE, "build", "pxd")
    links = {os.path.join(root, "pyrdma", "_verbs"): os.path.join(HERE, "pyx"),
             os.path.join(root, "pyrdma", "_engine.pxd"): os.path.join(HERE, "pyx", "engine.pxd")}
    for link, target in links.items():
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
    return root


def _extensions():
    from Cython.Build import cythonize

    # the loader before libdl: with --as-needed, a library must come after its user
    common = dict(include_dirs=[os.path.join(HERE, "include"), os.path.join(HERE, "pyx")],
                  extra_compile_args=["-O3", "-Wno-unused-function"],
                  libraries=[RUNTIME_LOADER[0]] + _loader_libraries(),
                  depends=RUNTIME_LOADER[1]["sources"] + ["include/pyrdma_dl.h"])
    exts = [Extension(f"pyrdma._verbs.{m}", [f"pyx/{m}.pyx"], **common) for m in VERBS_MODULES]
    exts += [Extension(name, [f"pyx/{src}.pyx"], **common) for src, name in OTHER_MODULES.items()]
    return cythonize(exts, include_path=[_pxd_include_path(), os.path.join(HERE, "pyx")],
                     language_level=3, compiler_directives={"embedsignature": True},
                     nthreads=os.cpu_count() or 1)


if any(cmd in sys.argv for cmd in ("build_ext", "build", "install", "bdist_wheel", "develop", "editable_wheel")):
    _check_libibverbs()
    ext_modules = _extensions()
else:
    ext_modules = []


class BuildExt(build_ext):
    """build_ext that builds the loader's static library first (`build` and the wheel do it anyway;
    `build_ext --inplace` alone would not)."""

    def run(self):
        self.run_command("build_clib")
        super().run()


setup(
    name="pyrdma",
    version="0.1.0",
    description="RDMA verbs from Python: Cython over libibverbs, collectives, perftest-style benchmarks",
    packages=find_packages(include=["pyrdma", "pyrdma.*"]),
    ext_modules=ext_modules,
    libraries=[RUNTIME_LOADER],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    install_requires=["numpy>=1.21"],
    extras_require={"cuda": ["cupy"], "torch": ["torch>=2.13,<2.15"], "test": ["pytest"], "bench": ["matplotlib"]},
    # typing: py.typed and the stubs of the compiled modules (checked by tests/test_stubs.py)
    package_data={"pyrdma": ["py.typed", "*.pyi"], "pyrdma._verbs": ["*.pyi"]},
    entry_points={"console_scripts": ["pyrdma-perf=pyrdma.perf.cli:main",
                                      "pyrdma-doctor=pyrdma.doctor:main",
                                      "pyrdma-vm=pyrdma.testing.vm:main"]},
    zip_safe=False,
)
