"""Reading a process's Prometheus metrics in tests: one scrape over HTTP, parsed by prometheus_client's
own text parser, its samples by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

#: A sample's labels, sorted: a dictionary key.
Labels = tuple[tuple[str, str], ...]


def scrape_text(port: int) -> str:
    """The exposition text of the metrics server on loopback `port` (it must answer 200)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200, reply.status
        text: str = reply.read().decode()
    return text


def all_samples(text: str) -> dict[tuple[str, Labels], float]:
    """Every sample of an exposition text, by its name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def samples(text: str, name: str) -> dict[Labels, float]:
    """Every sample called `name` in an exposition text, by its labels."""
    return {labels: value for (sample, labels), value in all_samples(text).items() if sample == name}


def scrape(port: int, name: str) -> dict[Labels, float]:
    """The samples called `name` of the metrics server on `port`, by their labels."""
    return samples(scrape_text(port), name)
