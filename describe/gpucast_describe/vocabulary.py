"""The service's names for the values of the setup fields (`gpucast vocabulary`): the
vocabulary.json beside this file is that output (package data; in the repository a link to the
client's python/src/gpucast/vocabulary.json, which the service's tests hold to the enums that
parse the fields), and describe's lists of optimizers, precisions and the rest are read from it
rather than typed again."""

import json
import os

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "vocabulary.json")) as _handle:
    # Request field (dotted for a nested one) -> its canonical names, in the docs' order.
    VOCABULARY = json.load(_handle)
