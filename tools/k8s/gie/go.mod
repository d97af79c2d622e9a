module local.invalid/phasewise-gie-crds

go 1.26.0

// Not built: the module ships the InferencePool CRD manifest (config/crd/bases) that
// tools/k8s/build.sh copies into the test binaries' cache for tests/k8s.
require sigs.k8s.io/gateway-api-inference-extension v1.6.0
