"""The machine's interconnect: probes and parsers, link measurement, the reduction layout and its cost model."""
