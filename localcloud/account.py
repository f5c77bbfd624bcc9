"""The local cloud's one account, its administrator and the mark of its own requests: what
cloud.py and the glue (IAM's identities, the front door) both need, kept below them both."""

ACCOUNT_ID = "123456789012"
"""moto's default account: every request with the fake credentials lands in it."""

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_SESSION_TOKEN": "testing"}
"""The deployer's and the harness's credentials: a session of the local administrator role
(glue/iam.py), valid also once IAM is enforced. Lambda functions and instances never get them."""
ADMIN_ROLE = "localcloud-admin"
"""The local administrator: its role sessions and its user's key are the identities that are
not a deployed role's (glue/iam.py)."""
INTERNAL_HEADER = "X-Localcloud-Internal"
"""Marks a request of the local cloud's own plumbing (LocalCloud.internal_client)."""
