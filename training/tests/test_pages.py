"""pages: a report's Markdown to its JSON and back, and the page a stage keeps of it."""

import json
import shutil
import tempfile
import unittest
from pathlib import Path

from gpucast_training import decisions, evaluate, mlp_report, pages, setup_simulations, simulated_report, stacks

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "reports"

REPORT = """# A report

Written by `python -m gpucast_training x` on 2026-01-01 00:00 UTC at commit `abc1234`.

## Summary (3 rows)

Some words.

| a | b |
| --- | ---: |
| 1 | 2 |
| 3 | 4 |

## Detail

| c |
| --- |
| 5 |
"""


class PagesTest(unittest.TestCase):
    def test_parse_keeps_every_section_paragraph_and_table(self):
        sections = pages.parse(REPORT)
        self.assertEqual([s["heading"] for s in sections], ["A report", "Summary (3 rows)", "Detail"])
        self.assertEqual(sections[1]["blocks"][0], {"text": "Some words."})
        self.assertEqual(sections[1]["blocks"][1], {"columns": ["a", "b"], "rows": [["1", "2"], ["3", "4"]]})
        self.assertEqual(pages.table("Detail", sections)["rows"], [["5"]])

    def test_the_page_keeps_the_head_and_the_named_sections_and_renders_again_from_its_json(self):
        with tempfile.TemporaryDirectory() as folder:
            page = Path(folder) / "x.md"
            written = pages.write(page, REPORT, {"Summary": [1]}, "x")
            data = json.loads(page.with_suffix(".json").read_text())
            self.assertEqual(data["sections"], pages.parse(REPORT))
            self.assertIn("at commit `abc1234`", written)
            self.assertIn("| 3 | 4 |", written)
            self.assertNotIn("Some words.", written)
            self.assertNotIn("## Detail", written)
            self.assertIn("[x.json](x.json)", written)
            self.assertIn("python -m gpucast_training x --from-data", written)
            page.write_text("")
            self.assertEqual(pages.render(page, {"Summary": [1]}, "x"), written)

    def test_each_committed_page_is_what_its_json_renders(self):
        stages = [
            ("accuracy.md", decisions.KEEP, "decisions", None),
            ("setup-simulations.md", setup_simulations.KEEP, "setup-simulations", None),
            ("training-real.md", evaluate.KEEP, "evaluate", None),
            ("training-mlp.md", mlp_report.KEEP, "mlp", None),
            ("stack-learning.md", {}, "stacks", stacks.summary),
        ]
        with tempfile.TemporaryDirectory() as folder:
            for name, keep, stage, summary in stages:
                page = Path(folder) / name
                shutil.copy(REPORTS / name.replace(".md", ".json"), page.with_suffix(".json"))
                rendered = pages.render(page, keep, stage, summary)
                self.assertEqual(rendered, (REPORTS / name).read_text(), f"{name}: run `{stage} --from-data`")
            figures = json.loads((REPORTS.parents[1] / "data/timm/simulated_figures.json").read_text())
            page = Path(folder) / "training-simulated.md"
            simulated_report.write_report(figures, page)
            self.assertEqual(page.read_text(), (REPORTS / "training-simulated.md").read_text())


if __name__ == "__main__":
    unittest.main()
