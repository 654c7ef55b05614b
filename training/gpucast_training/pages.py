"""A report page and its data: a stage composes its whole report in Markdown, every section and
table of it goes to a JSON file beside the page (docs/reports/NAME.json, tables as columns and
rows), and the page keeps its head and the sections a reader needs. `render` writes the page
again from the committed JSON alone (`python -m gpucast_training STAGE --from-data`), so a
stage that needs GPUs, describe or an hour of training can have its page re-rendered anywhere.
"""

import json
from pathlib import Path


def _cells(line):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def parse(markdown):
    """[{heading, level, blocks}]: the sections of `markdown` in order (the first is the title's);
    each block a paragraph {"text"} or a table {"columns", "rows"}."""
    sections = []
    section = {"heading": None, "level": 0, "blocks": []}
    paragraph, table = [], None

    def flush():
        nonlocal paragraph, table
        if paragraph:
            section["blocks"].append({"text": "\n".join(paragraph)})
        if table is not None:
            section["blocks"].append(table)
        paragraph, table = [], None

    for line in markdown.splitlines():
        if line.startswith("#"):
            flush()
            if section["heading"] is not None or section["blocks"]:
                sections.append(section)
            marks = len(line) - len(line.lstrip("#"))
            section = {"heading": line[marks:].strip(), "level": marks, "blocks": []}
        elif line.startswith("|"):
            if table is None:
                flush()
                table = {"columns": _cells(line), "rows": []}
            elif not set(line.replace("|", "").strip()) <= set("-: "):
                table["rows"].append(_cells(line))
        elif not line.strip():
            flush()
        else:
            if table is not None:
                flush()
            paragraph.append(line)
    flush()
    sections.append(section)
    return sections


def _block(block):
    if "text" in block:
        return block["text"]
    lines = ["| " + " | ".join(block["columns"]) + " |", "|" + "|".join("---" for _ in block["columns"]) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in block["rows"]]
    return "\n".join(lines)


def table(section_heading, sections):
    """The first table of the section whose heading starts with `section_heading`."""
    for section in sections:
        if (section["heading"] or "").startswith(section_heading):
            return next(b for b in section["blocks"] if "rows" in b)
    raise KeyError(section_heading)


def markdown_table(columns, rows):
    return _block({"columns": columns, "rows": rows})


def _section(section, blocks=None):
    out = []
    if section["heading"] is not None:
        out.append("#" * section["level"] + " " + section["heading"])
    chosen = section["blocks"] if blocks is None else [section["blocks"][i] for i in blocks]
    out += [_block(b) for b in chosen]
    return out


def page(data, keep, data_name, stage, summary=None):
    """The page from the report's data: its title and head, a line naming the data file, and the
    sections named in `keep` ({heading, or the start of one: None for every block, or the
    blocks' indices}); `summary(sections)`, if given, adds blocks of its own after the head."""
    sections = data["sections"]
    out = _section(sections[0])
    out.append(
        f"This page keeps the summary; every section and table of the run is in [{data_name}]({data_name}), "
        f"from which `python -m gpucast_training {stage} --from-data` renders this page again."
    )
    if summary is not None:
        out += summary(sections)
    for section in sections[1:]:
        named = [k for k in keep if section["heading"].startswith(k)]
        if named:
            out += _section(section, keep[named[0]])
    return "\n\n".join(out) + "\n"


def write(page_path, markdown, keep, stage, summary=None):
    """Writes the whole report to the JSON beside `page_path` and the page from it."""
    page_path = Path(page_path)
    data_path = page_path.with_suffix(".json")
    data = {"page": page_path.name, "sections": parse(markdown)}
    data_path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    page_path.write_text(page(data, keep, data_path.name, stage, summary))
    return page_path.read_text()


def render(page_path, keep, stage, summary=None):
    """The page again, from the committed JSON beside it."""
    page_path = Path(page_path)
    data_path = page_path.with_suffix(".json")
    data = json.loads(data_path.read_text())
    page_path.write_text(page(data, keep, data_path.name, stage, summary))
    return page_path.read_text()
