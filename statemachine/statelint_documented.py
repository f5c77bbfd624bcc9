"""statelint, with ReaderConfig's InputType as the Step Functions guide documents it.

Run by the tools' interpreter, where statelint is installed (`make sam-tools`):

    .venv-sam/bin/python statemachine/statelint_documented.py machine.asl.json

statelint (3.1.0, the newest release) knows only MaxItems(Path) in an ItemReader's ReaderConfig,
and so refuses every reader of a file in S3: Step Functions reads a JSON array, CSV, JSON Lines,
Parquet or a manifest through `arn:aws:states:::s3:getObject` with `ReaderConfig.InputType` naming
which (AWS Step Functions Developer Guide, "ItemReader (Map)"). Here InputType is one of
ReaderConfig's optional fields, held to those documented values as statelint holds its own enums;
every other check is statelint's, unchanged.
"""

import sys

from statelint.cli import main
from statelint.fields.str_field import EnumStrField
from statelint.nodes.map_state import ReaderConfig

INPUT_TYPE = EnumStrField("InputType", ["CSV", "JSON", "JSONL", "PARQUET", "MANIFEST"])

statelints_fields = ReaderConfig.optional_fields
ReaderConfig.optional_fields = property(lambda config: [*statelints_fields.fget(config), INPUT_TYPE])

if __name__ == "__main__":
    sys.exit(main())
