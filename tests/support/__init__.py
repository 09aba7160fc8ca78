"""What the test tiers share: fakes and stubs of what cannot run here, helpers, constants."""
