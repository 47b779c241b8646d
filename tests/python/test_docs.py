"""The documentation against the tree: the README's table of TIDE_* variables names every
variable the code, scripts and tests read, and only those; every relative link in the
README and docs/ leads to a file that exists, and a link to a section, to a heading there."""
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


def _anchors(markdown: pathlib.Path) -> set:
    """The section anchors GitHub makes of a markdown file's headings: lower case, no
    punctuation but hyphens, spaces as hyphens, a repeated heading numbered -1, -2..."""
    anchors, seen = set(), {}
    in_code = False
    for line in markdown.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_relative_links_in_the_docs_exist():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "tests").rglob("README.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = []
    checked = sections = 0
    for doc in docs:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, section = target.partition("#")
            checked += 1
            file = doc.parent / path if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif section and file.suffix == ".md":
                sections += 1
                if section not in _anchors(file):
                    broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 10 and sections > 5, (checked, sections)
    assert not broken, f"links to files or sections that do not exist: {broken}"


def test_the_anchors_are_githubs():
    assert _anchors(ROOT / "README.md") >= {"measured-results", "environment-variables"}
    assert "the-papers-experiment-shrunk-to-this-cpu-tidebenchstep" in _anchors(ROOT / "README.md")
