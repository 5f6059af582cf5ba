"""Build pyrdma: Cython wrappers (pyx/) over the system libibverbs (rdma-core)."""
import os
import sys

from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
VERBS_HEADER = "infiniband/verbs.h"
CM_HEADER = "rdma/rdma_cma.h"
HEADER_DIRS = ["/usr/include", "/usr/local/include"]

# Low-level modules, one per verbs object: pyx/<name>.pyx -> pyrdma._verbs.<name>
VERBS_MODULES = ["base", "device", "pd", "mr", "cq", "wr", "srq", "ah", "mw", "qp"]
# Modules over other rdma-core libraries: name -> libraries (rdma_cm needs librdmacm-dev)
EXTRA_LIB_MODULES = {"cm": ["rdmacm", "ibverbs"]}
# Other compiled modules: pyx/<name>.pyx -> (pyrdma.<name>, libraries)
OTHER_MODULES = {"reduce": ("pyrdma._reduce", []), "engine": ("pyrdma._engine", ["ibverbs"])}


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


def _pxd_include_path():
    # Cython resolves `from pyrdma._verbs.x cimport ...` as pyrdma/_verbs/x.pxd on its include path;
    # the sources live flat in pyx/, so point a package-shaped link at them.
    root = os.path.join(HERE, "build", "pxd")
    link = os.path.join(root, "pyrdma", "_verbs")
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if not os.path.islink(link):
        if os.path.exists(link):
            os.remove(link)
        os.symlink(os.path.join(HERE, "pyx"), link)
    return root


def _extensions():
    from Cython.Build import cythonize

    common = dict(include_dirs=[os.path.join(HERE, "include"), os.path.join(HERE, "pyx")],
                  extra_compile_args=["-O3", "-Wno-unused-function"])
    exts = [Extension(f"pyrdma._verbs.{m}", [f"pyx/{m}.pyx"], libraries=["ibverbs"], **common)
            for m in VERBS_MODULES]
    exts += [Extension(f"pyrdma._verbs.{m}", [f"pyx/{m}.pyx"], libraries=libs, **common)
             for m, libs in EXTRA_LIB_MODULES.items()]
    for src, (name, libs) in OTHER_MODULES.items():
        exts.append(Extension(name, [f"pyx/{src}.pyx"], libraries=libs, **common))
    return cythonize(exts, include_path=[_pxd_include_path(), os.path.join(HERE, "pyx")],
                     language_level=3, compiler_directives={"embedsignature": True},
                     nthreads=os.cpu_count() or 1)


if any(cmd in sys.argv for cmd in ("build_ext", "build", "install", "bdist_wheel", "develop", "editable_wheel")):
    _check_libibverbs()
    ext_modules = _extensions()
else:
    ext_modules = []

setup(
    name="pyrdma",
    version="0.1.0",
    description="RDMA verbs from Python: Cython over libibverbs, collectives, perftest-style benchmarks",
    packages=find_packages(include=["pyrdma", "pyrdma.*"]),
    ext_modules=ext_modules,
    python_requires=">=3.9",
    install_requires=["numpy>=1.21"],
    extras_require={"cuda": ["cupy"], "torch": ["torch>=2.13,<2.15"], "test": ["pytest"], "bench": ["matplotlib"]},
    entry_points={"console_scripts": ["pyrdma-perf=pyrdma.perf.cli:main",
                                      "pyrdma-vm=pyrdma.testing.vm:main"]},
    zip_safe=False,
)
