"""Pure builders of KubeRay custom resources: plain dicts in, plain dicts out."""
