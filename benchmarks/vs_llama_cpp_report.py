"""`benchmarks/vs_llama_cpp.py`'s tables: Tandem against llama.cpp per setting, each setting against the first
(its speed-ups, and its compiled step broken down), its eager step broken down, and which llama.cpp runs went
without their repacked weights."""

from __future__ import annotations


def print_table(records: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(f"{'setting':<8}{'Tandem tok/s (eager, compiled)':>32}{'llama.cpp tg':>14}{'ratio':>8}{'roofline':>10}"
          f"{'Tandem pp512':>14}{'llama.cpp pp512':>17}{'ratio':>8}")  # fmt: skip
    for r in records:
        print(
            f"{r['setting']:<8}{r['tandem_decode_eager']:>20.1f}{r['tandem_decode_compiled']:>12.1f}"
            f"{r['llama_decode']:>14.1f}{r['decode_ratio']:>7.2f}x{r['roofline']:>10.0%}"
            f"{r['tandem_prefill']:>14.0f}{r['llama_prefill']:>17.0f}{r['prefill_ratio']:>7.2f}x"
        )


def print_breakdown(records: list[dict]) -> None:
    """Each setting against the first (its speed-ups), and where its compiled decode step goes: the first
    round's step, and the same step in a graph that names its loops for the profiler, broken down."""
    base = records[0]
    print(f"\nagainst {base['setting']}: decode (best of eager and compiled, rounds' medians), the compiled step "
          "paired in one process (median, range),\nprefill; a compiled step, ms: as timed, and named for the "
          "profiler, broken down: weight products and attention\n(GB/s they read), the graph's element-wise "
          "loops, the rest")  # fmt: skip
    print(f"{'setting':<8}{'decode':>8}{'paired':>21}{'prefill':>9}{'step':>7}{'named':>7}{'products':>15}"
          f"{'attention':>15}{'element-wise':>14}{'the rest':>10}")  # fmt: skip
    best = lambda r: max(r["tandem_decode_eager"], r["tandem_decode_compiled"])  # noqa: E731
    for r in records:
        b, timed = r["breakdown"], 1e3 / r["rounds"][0][0]["decode_compiled"]
        paired_ = "{:.2f}x ({:.2f}-{:.2f})".format(r["paired"]["speedup"], *r["paired"]["speedup_range"])
        print(f"{r['setting']:<8}{best(r) / best(base):>7.2f}x{paired_:>21}"
              f"{r['tandem_prefill'] / base['tandem_prefill']:>8.2f}x"
              f"{timed:>7.2f}{b['step_ms']:>7.2f}{b['products_ms']:>8.2f} ({b['products_gbps']:>4.1f})"
              f"{b['attention_ms']:>8.2f} ({b['attention_gbps']:>4.1f}){b['elementwise_ms']:>14.2f}"
              f"{b['rest_ms']:>10.2f}")  # fmt: skip


def print_eager_breakdown(records: list[dict]) -> None:
    """Where each setting's eager step goes (the first round's; `decode_roofline_measure.eager_breakdown`)."""
    print(
        "\nthe eager step, ms (GB/s read): the layers' pass (products, attention and the steps between), "
        "the LM head, the rest"
    )
    print(f"{'setting':<8}{'step':>8}{'layers':>16}{'LM head':>16}{'the rest':>10}")
    for r in records:
        b = r["rounds"][0][0]["eager_breakdown"]
        print(f"{r['setting']:<8}{b['step_ms']:>8.2f}{b['layers_ms']:>9.2f} ({b['layers_gbps']:>4.1f})"
              f"{b['lm_head_ms']:>9.2f} ({b['lm_head_gbps']:>4.1f}){b['rest_ms']:>10.2f}")  # fmt: skip


def say_unrepacked(records: list[dict]) -> None:
    """Which of llama.cpp's runs went without its weights' repacking, because they crashed with it."""
    for r in records:
        ways = ("_without_repacking", "_one_token_batches")
        crashed = sorted({k for _, theirs in r["rounds"] for k in theirs if k.endswith(ways)})
        if crashed:
            print(f"{r['setting']}: llama.cpp ran {', '.join(crashed)} (its repacked weights crashed otherwise)")
