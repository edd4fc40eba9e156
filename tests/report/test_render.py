"""kvsum/report/render.py: HTML and markdown renderings."""

from kvsum.report.render import render


def test_render_escapes_and_counts_plots(tmp_path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    h, m = render([("p", "a <b> & `c` **d**"), ("plot", "one", fig), ("table", ["x"], [["<y>"]])], tmp_path, "T")
    page = h.read_text()
    assert "a &lt;b&gt; &amp; <code>c</code> <b>d</b>" in page and "<td>&lt;y&gt;</td>" in page
    assert 'data-plots="1"' in page and (tmp_path / "plots" / "one.png").is_file()
    assert "![one](plots/one.png)" in m.read_text()
