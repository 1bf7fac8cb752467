"""pdserve: disaggregated prefill/decode LLM serving over gRPC.

The ``pdserve`` command lives in pdserve.cli (main.py, commands/, launcher.py); the Python
client in pdserve.client; generated protobuf stubs in pdserve.<area>.v1 (produced by
scripts/gen_protos.sh, never edited by hand).
"""

__version__ = "0.1.0"
