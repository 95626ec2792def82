#!/usr/bin/env python3
"""Checks ffi.rs against installed oneDNN headers with the C compiler.

Usage: python3 check_ffi.py <include dir> [cc]
  e.g. python3 check_ffi.py "$(python3 -c 'import sys; print(sys.prefix)')/include"

Why: ffi.rs transliterates the C API by hand, and a wrong constant or parameter type is
undefined behaviour that no Rust test reliably catches. This script turns every `pub const`,
every `pub type` alias of a C enum, the two struct layouts and every function-pointer entry of
ffi.rs into C11 static assertions and typed assignments, then compiles them with -Werror: a
value, size, layout or signature that differs from the headers fails the build.
"""

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

SCALARS = {
    "c_int": "int",
    "c_uint": "unsigned int",
    "c_float": "float",
    "c_char": "char",
    "c_void": "void",
    "usize": "size_t",
    "i64": "int64_t",
}

# Constants that are not plain integers in C, checked by hand below.
SPECIAL = {"DNNL_MEMORY_NONE", "DNNL_MEMORY_ALLOCATE"}


def c_type(rust):
    """Translates a Rust FFI type (as written in ffi.rs) to a C type."""
    rust = rust.strip()
    m = re.fullmatch(r"\*(mut|const)\s+(.+)", rust)
    if m:
        inner = c_type(m.group(2))
        return ("const " if m.group(1) == "const" else "") + inner + " *"
    return SCALARS.get(rust, rust)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    include = sys.argv[1]
    cc = sys.argv[2] if len(sys.argv) > 2 else "cc"
    src = open(os.path.join(HERE, "ffi.rs")).read()

    out = [
        "#include <stddef.h>",
        "#include <stdint.h>",
        "#include <omp.h>",
        '#include "oneapi/dnnl/dnnl.h"',
        "void check(void) {",
    ]
    n_const = n_type = n_fn = 0

    for name, value in re.findall(r"^pub const (\w+):\s*[\w]+\s*=\s*([^;]+);", src, re.M):
        if name in SPECIAL:
            continue
        # The value is a literal or another constant's name: valid C as written.
        out.append(f'_Static_assert((long long)({name}) == (long long)({value}), "{name}");')
        n_const += 1
    out.append('_Static_assert(DNNL_MEMORY_NONE == NULL, "DNNL_MEMORY_NONE");')
    # DNNL_MEMORY_ALLOCATE is ((void *)(size_t)-1) in dnnl_types.h, i.e. usize::MAX as a
    # pointer; a pointer constant cannot be compared at compile time, so only its type is.
    out.append("{ void *allocate = DNNL_MEMORY_ALLOCATE; (void)allocate; }")

    for name, rust in re.findall(r"^pub type (\w+)\s*=\s*(c_uint|c_int|i64);", src, re.M):
        ct = SCALARS[rust]
        out.append(f'_Static_assert(sizeof({name}) == sizeof({ct}), "size of {name}");')
        if rust == "c_uint":
            out.append(f'_Static_assert(({name})-1 > 0, "{name} is unsigned");')
        n_type += 1
    out.append('_Static_assert(sizeof(dnnl_dims_t) == 12 * 8, "dnnl_dims_t");')

    layouts = {
        "dnnl_version_t": (
            32,
            {"major": 0, "minor": 4, "patch": 8, "hash": 16, "cpu_runtime": 24, "gpu_runtime": 28},
        ),
        "dnnl_exec_arg_t": (16, {"arg": 0, "memory": 8}),
    }
    for struct, (size, fields) in layouts.items():
        out.append(f'_Static_assert(sizeof({struct}) == {size}, "size of {struct}");')
        for field, off in fields.items():
            out.append(
                f'_Static_assert(offsetof({struct}, {field}) == {off}, "{struct}.{field}");'
            )

    block = re.search(r"^api! \{\n(.*?)^\}", src, re.M | re.S).group(1)
    entries = re.findall(r"^\s*(\w+)\((.*?)\)\s*(?:->\s*([^;]+))?;", block, re.M)
    fields = re.findall(
        r"pub (omp_\w+): unsafe extern \"C\" fn\((.*?)\)\s*(?:->\s*([^,]+))?,", src
    )
    for name, params, ret in entries + fields:
        args = []
        for p in filter(None, (p.strip() for p in params.split(","))):
            _, ty = p.split(":", 1)
            args.append(c_type(ty))
        ret_c = c_type(ret) if ret else "void"
        out.append(
            f"{{ {ret_c} (*p)({', '.join(args) or 'void'}) = {name}; (void)p; }}"
        )
        n_fn += 1

    out.append("}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "check.c")
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")
        cmd = [cc, "-std=c11", "-fopenmp", "-Werror", "-Wall", "-Wno-unused-variable",
               "-fsyntax-only", "-I", include, path]
        r = subprocess.run(cmd)
        if r.returncode != 0:
            sys.exit(f"ffi.rs does not match the headers in {include}")
    print(f"ok: {n_const} constants, {n_type} enum types, 2 structs, {n_fn} functions match {include}")


if __name__ == "__main__":
    main()
