"""Imported last by the ranks' fork server of a launcher that starts ranks many times
(``forkserver.MANY_LAUNCHES``): what every rank's first model load would otherwise do again after
each fork, done once. transformers' table of checkpoint renamings (a few thousand regular
expressions, compiled when first asked for: ~0.3 s a rank on a 2-core machine) and the modules
of the known families' causal LMs. A transformers that does it otherwise loses the head start,
nothing else."""

import contextlib

from transformers.models.auto import configuration_auto, modeling_auto

from .load import KNOWN_FAMILIES

with contextlib.suppress(Exception):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")
for family in KNOWN_FAMILIES:
    with contextlib.suppress(Exception):
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[configuration_auto.CONFIG_MAPPING[family]]  # imports it
