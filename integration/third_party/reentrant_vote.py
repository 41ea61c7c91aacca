"""A third-party plugin that votes reentrant where it is wrong: it says its (imagined) offloader
needs reentrant checkpointing, for every model. No built-in rule contradicts it on a model whose
layers take their hidden states by keyword once the torch plugin is blocked: only verify's
measurement of the first step shows the gradients it costs (integration/test_verify_fix.py)."""

from gcpatch.hookspecs import hookimpl
from gcpatch.schema import CRASH, REQUIRED, USE_REENTRANT, PluginInfo, Rule, Vote

INFO = PluginInfo(
    name="reentrant_vote",
    framework="torch",
    versions=">=2",
    rules=(
        Rule(
            "Z1",
            "the offloader needs reentrant checkpointing",
            "integration/third_party/reentrant_vote.py",
        ),
    ),
)


@hookimpl
def gcpatch_plugin_info():
    return INFO


@hookimpl
def gcpatch_vote(facts):
    if facts.stage != "enable":
        return []
    return [
        Vote(
            USE_REENTRANT,
            True,
            REQUIRED,
            "Z1",
            "the offloader runs reentrant only",
            avoids=CRASH,
            short="offloader needs reentrant",
        )
    ]
