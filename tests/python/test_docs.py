"""The documentation against the tree: the README's table of TIDE_* variables names every
variable the code, scripts and tests read, and only those; every relative link in the
README and docs/ leads to a file that exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Where variables are read: sources, scripts, tests, benchmark scripts (not their results,
# not the docs, not build outputs).
SCANNED = ["src", "include", "kernels", "python", "scripts", "tests", "benchmarks", ".ci",
           "Makefile", "CMakeLists.txt", "examples"]
SUFFIXES = {".cpp", ".hpp", ".h", ".cu", ".cuh", ".py", ".sh", ""}
# A variable read: a quoted name (C++ getenv / tide's env helpers, os.environ, monkeypatch)
# or a shell expansion ($TIDE_..., ${TIDE_...}).
READ = re.compile(r"""["']TIDE_[A-Z0-9_]+["']|\$\{?TIDE_[A-Z0-9_]+""")
NAME = re.compile(r"TIDE_[A-Z0-9_]+")


def _sources():
    for entry in SCANNED:
        path = ROOT / entry
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            if "results" in f.parts or "__pycache__" in f.parts or f.suffix not in SUFFIXES:
                continue
            yield f


def variables_read() -> dict:
    found: dict = {}
    for f in _sources():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for hit in READ.findall(text):
            found.setdefault(NAME.search(hit).group(0), []).append(str(f.relative_to(ROOT)))
    return found


def variables_documented() -> set:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(NAME.findall(line.split("|")[1]))
    return names


def test_every_variable_read_is_in_the_readme_table():
    read, documented = variables_read(), variables_documented()
    missing = {n: sorted(set(where))[:3] for n, where in read.items() if n not in documented}
    assert not missing, f"TIDE_* variables read but not in the README's table: {missing}"
    stale = documented - set(read)
    assert not stale, f"README's table names variables nothing reads: {sorted(stale)}"


def test_the_scan_sees_variables_of_every_kind():
    # The scan itself can fail: a C++ read, a Python read and a shell read are all found.
    read = variables_read()
    assert any(w.startswith("src/") for w in read["TIDE_HOST_SPIN_US"]), read["TIDE_HOST_SPIN_US"]
    assert any(w.startswith("python/") for w in read["TIDE_FSDP"]), read["TIDE_FSDP"]
    assert any(w.startswith("scripts/") for w in read["TIDE_TORCH"]), read["TIDE_TORCH"]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_in_the_docs_exist():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "tests").rglob("README.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = []
    checked = 0
    for doc in docs:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            checked += 1
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert checked > 10, checked
    assert not broken, f"links to files that do not exist: {broken}"
