"""The images' run-time root filesystem (engine/Dockerfile and control_plane/Dockerfile, stage
`rootfs`), distroless-style: only what the Python program runs on, assembled from the build stage.

    python3.11 image_rootfs.py ROOTFS [PATH...]

Into ROOTFS it copies the venv /opt/meshcache, Debian's python3.11 and standard library (less the
parts a server never imports), every shared library those ELF files load (ldd, followed through
symlinks, so merged-/usr links are recreated as links), the C.UTF-8 locale, the few /etc files a
process reads (users, name service, MIME types) and any extra PATHs. No shell, apt, dpkg or perl:
nothing in the image can install or run anything but Python. For scanners and licences, each
Debian package a copied file comes from is recorded as /var/lib/dpkg/status.d/NAME (its dpkg
status stanza, as distroless images do) with its copyright file. Run in the build stage only; it
exits non-zero if a library cannot be resolved."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

VENV = Path("/opt/meshcache")
PYTHON = Path("/usr/bin/python3.11")
STDLIB = Path("/usr/lib/python3.11")
# Standard-library parts a server never imports: tests, IDLE, Tk, 2to3, pip's bootstrap, docs,
# and the extension modules for terminals and dbm (they would pull in ncurses, readline, Berkeley DB).
STDLIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "venv",
               "distutils", "config-3.11-x86_64-linux-gnu"}
DYNLOAD_SKIP = ("readline.", "_curses", "_dbm.", "_gdbm.", "nis.", "_tkinter.", "_ctypes_test.", "_testcapi.",
                "_testbuffer.", "_testinternalcapi.", "_testimportmultiple.", "_testmultiphase.", "_xxtestfuzz.",
                "xxlimited")
# Files read by the process itself (name service, MIME types for starlette, OpenSSL's config,
# Python's site customization, the C.UTF-8 locale) and the distribution's identity for scanners.
ETC = ["/etc/os-release", "/etc/nsswitch.conf", "/etc/mime.types", "/usr/lib/ssl/openssl.cnf", "/etc/python3.11",
       "/usr/lib/locale/C.utf8", "/etc/host.conf"]
USER_ID = 10001


def add(root: Path, path: str) -> Path:
    """Copy `path` into root, recreating every symlink met on the way (each component's), and
    return the real path it resolved to."""
    parts = Path(path).parts
    current = Path("/")
    for i, part in enumerate(parts[1:], start=1):
        step = current / part
        if step.is_symlink():
            target = os.readlink(step)
            link = root / step.relative_to("/")
            if not link.is_symlink():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(target)
            resolved = Path(os.path.normpath(current / target))
            return add(root, str(resolved.joinpath(*parts[i + 1:])))
        current = step
    dest = root / current.relative_to("/")
    if current.is_dir():
        shutil.copytree(current, dest, symlinks=True, dirs_exist_ok=True)
    elif not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(current, dest)
    return current


def _stdlib_ignore(directory: str, names: list[str]) -> set[str]:
    if Path(directory) == STDLIB:
        return {n for n in names if n in STDLIB_SKIP}
    if Path(directory) == STDLIB / "lib-dynload":
        return {n for n in names if n.startswith(DYNLOAD_SKIP)}
    return set()


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def needed(path: Path) -> list[str]:
    """The libraries the dynamic loader maps for `path` (ldd), failing on any it cannot find."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
    libs = []
    for line in out.splitlines():
        line = line.strip()
        if "not found" in line:
            sys.exit(f"image_rootfs: {path}: {line}")
        if "=>" in line:
            target = line.split("=>", 1)[1].split("(")[0].strip()
            if target:
                libs.append(target)
        elif line.startswith("/"):
            libs.append(line.split("(")[0].strip())  # the ELF interpreter
    return libs


def record_packages(root: Path) -> None:
    """/var/lib/dpkg/status.d/PACKAGE and its copyright for each Debian package with a file here."""
    files = [str(Path("/") / p.relative_to(root)) for p in root.rglob("*")
             if not p.is_dir() and not str(p.relative_to(root)).startswith(("opt/", "var/lib/dpkg/"))]
    # dpkg knows merged-/usr files by their old names (/lib/..., /bin/...): ask for both.
    files += [f[len("/usr"):] for f in files if f.startswith(("/usr/lib/", "/usr/bin/", "/usr/sbin/"))]
    packages: set[str] = set()
    for chunk in range(0, len(files), 200):
        out = subprocess.run(["dpkg-query", "-S", *files[chunk:chunk + 200]], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if ": " in line:
                packages.update(p.strip().split(":")[0] for p in line.split(": ", 1)[0].split(","))
    status = root / "var/lib/dpkg/status.d"
    status.mkdir(parents=True, exist_ok=True)
    for name in sorted(packages):
        stanza = subprocess.run(["dpkg-query", "-s", name], capture_output=True, text=True, check=True).stdout
        (status / name).write_text(stanza)
        copyright_file = Path("/usr/share/doc") / name / "copyright"
        if copyright_file.exists():
            add(root, str(copyright_file))


def users(root: Path) -> None:
    """root, nobody and the pods' user (runAsUser 10001), no login shells."""
    etc = root / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                                f"meshcache:x:{USER_ID}:{USER_ID}:meshcache:/nonexistent:/usr/sbin/nologin\n")
    (etc / "group").write_text(f"root:x:0:\nnogroup:x:65534:\nmeshcache:x:{USER_ID}:\n")


def main(argv: list[str]) -> None:
    root = Path(argv[0])
    root.mkdir(parents=True, exist_ok=True)
    add(root, str(VENV))
    add(root, str(PYTHON))
    shutil.copytree(STDLIB, root / STDLIB.relative_to("/"), symlinks=True, ignore=_stdlib_ignore,
                    dirs_exist_ok=True)
    for path in [*ETC, *argv[1:]]:
        add(root, path)
    # Links inside the copied trees that point out of them (sitecustomize.py -> /etc/python3.11).
    for link in [p for p in root.rglob("*") if p.is_symlink()]:
        target = Path(os.path.normpath(link.parent / os.readlink(link)))
        inside = Path("/") / target.relative_to(root) if target.is_relative_to(root) else target
        if not (root / inside.relative_to("/")).exists() and inside.exists():
            add(root, str(inside))
    # Every ELF file's libraries, until nothing new is added (a library's own dependencies).
    seen: set[Path] = set()
    while True:
        elves = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p not in seen and is_elf(p)]
        if not elves:
            break
        for elf in elves:
            seen.add(elf)
            for lib in needed(Path("/") / elf.relative_to(root)):
                add(root, lib)
    users(root)
    (root / "tmp").mkdir(exist_ok=True)
    (root / "tmp").chmod(0o1777)
    record_packages(root)
    # No setuid/setgid bit survives (none is expected; this makes sure).
    for p in root.rglob("*"):
        if not p.is_symlink() and p.stat().st_mode & (stat.S_ISUID | stat.S_ISGID):
            p.chmod(p.stat().st_mode & ~(stat.S_ISUID | stat.S_ISGID))


if __name__ == "__main__":
    main(sys.argv[1:])
