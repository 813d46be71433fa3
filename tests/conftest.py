"""Suite-wide test settings."""

from hypothesis import settings

# CI runs on a shared 2-core machine: wall-clock deadlines would make property tests
# flaky without testing anything; a failure prints its reproduction blob.
settings.register_profile("dflash", deadline=None, print_blob=True)
settings.load_profile("dflash")
