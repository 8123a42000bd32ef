"""The mapping layer: rule sets that carry source names and layouts to JAX trees and back."""
