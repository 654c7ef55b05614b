//! The AdmissionReview of `admission.k8s.io/v1` as the API server sends it and reads the
//! answer (Kubernetes' own wire format, so kept apart from `api::types`). Only the fields the
//! webhook reads are declared; the rest of what the API server sends (`userInfo`,
//! `oldObject`, `options`, ...) is accepted and ignored.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The `apiVersion` the webhook speaks (its configuration lists only this one).
pub const ADMISSION_API_VERSION: &str = "admission.k8s.io/v1";

/// Longest `request.uid` echoed back: the API server's are UUIDs (36 characters).
pub const MAX_UID_CHARS: usize = 128;

/// What the API server posts to a mutating admission webhook.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(example = json!({
    "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
    "request": {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE", "namespace": "team-a",
        "object": {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "train", "annotations": {"gpucast.dev/job":
                "{\"family\": \"mlp\", \"batch_size\": 256, \"layers\": [{\"kind\": \"linear\", \"output_size\": 4096, \"params\": 16781312}]}"}},
            "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
                "resources": {"limits": {"nvidia.com/gpu": 1}}}]}
        }
    }
}))]
pub struct AdmissionReviewRequest {
    /// `admission.k8s.io/v1`.
    #[serde(rename = "apiVersion")]
    #[schema(pattern = "^admission\\.k8s\\.io/v1$")]
    pub api_version: String,
    /// `AdmissionReview`.
    #[schema(pattern = "^AdmissionReview$")]
    pub kind: String,
    pub request: AdmissionRequest,
}

/// The object under review.
#[derive(Debug, Deserialize, ToSchema)]
pub struct AdmissionRequest {
    /// Echoed in the answer.
    #[schema(min_length = 1, max_length = 128)]
    pub uid: String,
    /// The kind of `object`: a Pod (`v1`), a Job (`batch/v1`) or a PyTorchJob
    /// (`kubeflow.org/v1`) is read; any other is allowed unchanged.
    pub kind: GroupVersionKind,
    /// `CREATE` is placed; `UPDATE`, `DELETE` and `CONNECT` are allowed unchanged (a pod's
    /// affinity cannot change after it is created). Required: a review that does not say
    /// what it is for is refused.
    #[schema(pattern = "^(CREATE|UPDATE|DELETE|CONNECT)$")]
    pub operation: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// The object as it would be stored (null on a DELETE), each key once at every depth
    /// (a repeated key is refused: serde would keep the last).
    #[serde(default, deserialize_with = "crate::api::unique_keys::optional_value")]
    #[schema(value_type = Option<Object>)]
    pub object: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct GroupVersionKind {
    /// Empty for the core group (a Pod).
    #[serde(default)]
    pub group: String,
    pub version: String,
    pub kind: String,
}

/// The webhook's answer.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AdmissionReviewResponse {
    #[serde(rename = "apiVersion")]
    pub api_version: String,
    pub kind: String,
    pub response: AdmissionResponse,
}

/// Allowed, perhaps with a patch; or denied with the reason.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionResponse {
    /// The request's `uid`.
    pub uid: String,
    pub allowed: bool,
    /// Why a request was denied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<AdmissionStatus>,
    /// `JSONPatch` when `patch` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch_type: Option<String>,
    /// Base64 of a JSON Patch (RFC 6902) against `request.object`: the node affinity and the
    /// `gpucast.dev/*` annotations of each placed pod (template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch: Option<String>,
    /// Shown to the client that created the object (kubectl prints them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A denial's status, as a Kubernetes `Status` carries it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AdmissionStatus {
    /// 422 for a job annotation that is not a valid job, 403 for a job that fits none of the
    /// cluster's GPUs.
    pub code: u16,
    pub message: String,
}

impl AdmissionResponse {
    /// Allowed as it is.
    pub fn allow(uid: &str) -> AdmissionResponse {
        AdmissionResponse {
            uid: uid.to_string(),
            allowed: true,
            status: None,
            patch_type: None,
            patch: None,
            warnings: Vec::new(),
        }
    }

    /// Denied, saying why.
    pub fn deny(uid: &str, code: u16, message: String) -> AdmissionResponse {
        AdmissionResponse {
            status: Some(AdmissionStatus { code, message }),
            allowed: false,
            ..AdmissionResponse::allow(uid)
        }
    }
}

impl AdmissionReviewResponse {
    pub fn new(response: AdmissionResponse) -> AdmissionReviewResponse {
        AdmissionReviewResponse {
            api_version: ADMISSION_API_VERSION.to_string(),
            kind: "AdmissionReview".to_string(),
            response,
        }
    }
}
