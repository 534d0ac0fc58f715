"""``pybroker bench``: flags -> BenchConfig and targets -> runner -> table, JSON, plot.

``register(app)`` adds the command to pybroker's command line; ``main()`` runs it alone
(``python loadtest/bench.py ...`` is the same command).
"""
from __future__ import annotations

import sys

import typer

from pybroker.bench.report import settings_line, table, write_json, write_plot
from pybroker.bench.runner import (
    Target,
    external_target,
    nsqd_target,
    pybroker_target,
    run_bench,
)
from pybroker.bench.scenarios import SCENARIOS, BenchConfig
from pybroker.bench.stats import parse_duration

HELP = ("Measure a broker's throughput, latency and memory with raw-socket load processes "
        "(modelled on nsq's bench_writer/bench_reader); with --vs-nsqd, side by side with "
        "a real nsqd.")


def bench(
    scenarios: str = typer.Option(",".join(SCENARIOS), "--scenarios",
                                  help=f"comma-separated, of: {', '.join(SCENARIOS)}"),
    size: int = typer.Option(200, "--size", help="message body bytes"),
    batch_size: int = typer.Option(200, "--batch-size", help="messages per MPUB (1: PUB)"),
    connections: int = typer.Option(0, "--connections",
                                    help="publisher and consumer connections (processes) "
                                         "each; 0: one per CPU"),
    duration: str = typer.Option("10s", "--duration", help="measured time per scenario"),
    depth: int = typer.Option(1, "--depth", help="MPUBs in flight per publisher"),
    rdy: int = typer.Option(2500, "--rdy", help="RDY count of throughput consumers"),
    rate: float = typer.Option(10_000, "--rate", help="latency scenario: messages/s"),
    latency_batch: int = typer.Option(1, "--latency-batch",
                                      help="latency scenario: messages per command (1: PUB)"),
    output_buffer_size: int = typer.Option(
        -1, "--output-buffer-size",
        help="latency consumer's IDENTIFY output_buffer_size (-1: unbuffered, 0: default)"),
    output_buffer_timeout: int = typer.Option(
        0, "--output-buffer-timeout",
        help="latency consumer's IDENTIFY output_buffer_timeout in ms (0: default)"),
    memory_messages: int = typer.Option(1_000_000, "--memory-messages",
                                        help="memory scenario: messages queued"),
    memory_size: int = typer.Option(100, "--memory-size", help="memory scenario: body bytes"),
    memory_verify: bool = typer.Option(True, "--memory-verify/--no-memory-verify",
                                       help="drain and count the memory scenario's queue"),
    runs: int = typer.Option(1, "--runs", help="runs of every scenario (medians reported)"),
    vs_nsqd: str | None = typer.Option(None, "--vs-nsqd", metavar="PATH",
                                          help="also run every scenario on this nsqd binary"),
    tcp_address: str | None = typer.Option(
        None, "--tcp-address", help="bench a running broker at HOST:PORT instead of "
                                    "starting pybroker (memory/RSS need --broker-pid)"),
    http_address: str | None = typer.Option(
        None, "--http-address", help="HTTP HOST:PORT of the --tcp-address broker (the bench "
                                     "deletes its topics there afterwards)"),
    broker_pid: int | None = typer.Option(None, "--broker-pid",
                                             help="PID of the --tcp-address broker"),
    pybroker_arg: list[str] = typer.Option([], "--pybroker-arg",  # noqa: B008
                                           help="extra flag for pybroker serve (repeatable)"),
    nsqd_arg: list[str] = typer.Option([], "--nsqd-arg",  # noqa: B008
                                       help="extra flag for nsqd (repeatable)"),
    json_path: str = typer.Option("bench-results.json", "--json",
                                  help="write the results here ('' for none)"),
    table_path: str | None = typer.Option(None, "--table",
                                             help="also write the Markdown table here"),
    plot_path: str | None = typer.Option(None, "--plot",
                                            help="write a PNG of throughput and latency"),
) -> None:
    """Measure a broker's throughput, latency and memory (optionally vs a real nsqd)."""
    chosen = [s.strip() for s in scenarios.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown or not chosen:
        raise typer.BadParameter(f"unknown scenario(s) {unknown}; choose from {SCENARIOS}",
                                 param_hint="--scenarios")
    try:
        duration_s = parse_duration(duration)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--duration") from e
    if size < 8 and "latency" in chosen:
        raise typer.BadParameter("latency bodies carry an 8-byte stamp", param_hint="--size")
    cfg = BenchConfig(size=size, batch=max(1, batch_size), duration_s=duration_s,
                      depth=max(1, depth), rdy=rdy, rate=rate,
                      latency_batch=max(1, latency_batch), obuf_size=output_buffer_size,
                      obuf_timeout_ms=output_buffer_timeout, memory_messages=memory_messages,
                      memory_size=memory_size, memory_verify=memory_verify)
    if connections > 0:
        cfg.connections = connections
    targets: list[Target] = []
    if tcp_address:
        targets.append(external_target("pybroker", tcp_address, http_address or "",
                                       pid=broker_pid))
    else:
        targets.append(pybroker_target(list(pybroker_arg)))
    if vs_nsqd:
        targets.append(nsqd_target(vs_nsqd, list(nsqd_arg)))
    result = run_bench(targets, chosen, cfg, max(1, runs),
                       log=lambda line: typer.echo(line, err=True))
    text = table(result)
    typer.echo("")
    typer.echo(settings_line(result))
    typer.echo("")
    typer.echo(text)
    if json_path:
        write_json(result, json_path)
        typer.echo(f"\nresults: {json_path}")
    if table_path:
        with open(table_path, "w") as f:
            f.write(settings_line(result) + "\n\n" + text + "\n")
    if plot_path:
        write_plot(result, plot_path)
        typer.echo(f"plot: {plot_path}")
    failed = [r for r in result["records"] if "error" in r]
    if failed:
        typer.echo(f"{len(failed)} measurement(s) failed", err=True)
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``bench`` to ``app`` (pybroker's command line)."""
    app.command("bench", help=HELP)(bench)


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False, help=HELP)
    app.command(help=HELP)(bench)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="bench")
