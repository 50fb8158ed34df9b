//! The budget's ledger: a ConfigMap (`<name>-budget`) holding a place for each
//! quarantine decided and not yet released, written by compare-and-swap on its
//! resourceVersion, so replicas deciding at once count each other's decisions before
//! they land ([`super::policy::take_place`] decides; this reads and writes).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};

use super::error::RemediateError;
use super::policy::Place;

/// Attempts at one compare-and-swap before giving up for this pass.
const CAS_ATTEMPTS: usize = 8;

/// The ConfigMap holding the budget's places: `nodes` for quarantines, `unknown` for
/// the unknown guard's taints, each a JSON map of node → [`Place`].
pub struct Ledger {
    api: Api<ConfigMap>,
    name: String,
}

/// The ledger's key of the node budget's places.
pub(super) const NODES_KEY: &str = "nodes";
/// The ledger's key of the unknown guard's places.
pub(super) const UNKNOWN_KEY: &str = "unknown";

impl Ledger {
    /// The ledger in the ConfigMap `name` through `api` (created on first use).
    pub fn new(api: Api<ConfigMap>, name: String) -> Self {
        Ledger { api, name }
    }

    /// The places under `key` of the ledger as read now (a consistent read), and the
    /// ConfigMap they came from.
    async fn read(
        &self,
        key: &str,
    ) -> Result<(Option<ConfigMap>, BTreeMap<String, Place>), RemediateError> {
        let cm = self.api.get_opt(&self.name).await?;
        let places = match cm.as_ref().and_then(|c| c.data.as_ref()?.get(key)) {
            None => BTreeMap::new(),
            // A ledger that does not parse stops quarantines rather than undercount;
            // deleting the ConfigMap starts it again from the Nodes' count.
            Some(text) => serde_json::from_str(text).map_err(|e| {
                RemediateError::Record(self.name.clone(), format!("budget ledger {key}: {e}"))
            })?,
        };
        Ok((cm, places))
    }

    /// Write `places` under `key`, conditional on `cm` being the ConfigMap as read (its
    /// resourceVersion; none: it must not exist yet). `Ok(false)` on a conflict: another
    /// replica wrote first.
    async fn write(
        &self,
        key: &str,
        cm: Option<ConfigMap>,
        places: &BTreeMap<String, Place>,
    ) -> Result<bool, RemediateError> {
        let text = serde_json::to_string(places).unwrap_or_default();
        let mut data = cm.as_ref().and_then(|c| c.data.clone()).unwrap_or_default();
        data.insert(key.into(), text);
        let written = replace_or_create(&self.api, &self.name, cm, data).await;
        match written {
            Ok(()) => Ok(true),
            // A conflict on the resourceVersion, a create that met one, or a replace of
            // one deleted meanwhile: read again.
            Err(kube::Error::Api(e)) if e.code == 409 || e.code == 404 => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Change the places under `key` by `change` (a refusal: nothing written) until a
    /// compare-and-swap lands. The refusal, if any.
    pub(super) async fn update(
        &self,
        key: &str,
        mut change: impl FnMut(&mut BTreeMap<String, Place>) -> Result<bool, String>,
    ) -> Result<Option<String>, RemediateError> {
        for _ in 0..CAS_ATTEMPTS {
            let (cm, mut places) = self.read(key).await?;
            match change(&mut places) {
                Err(why) => return Ok(Some(why)),
                Ok(false) => return Ok(None),
                Ok(true) => {}
            }
            if self.write(key, cm, &places).await? {
                return Ok(None);
            }
        }
        Err(RemediateError::Record(
            self.name.clone(),
            format!("budget ledger {key}: {CAS_ATTEMPTS} writes met a conflict"),
        ))
    }
}

/// Write `data` as the ConfigMap `name`: a replace of `cur` as read (its resourceVersion
/// makes it a compare-and-swap: 409 when another writer came first), or a create when
/// none was read (409 when one was made meanwhile). The ledger's and the breaker's one
/// write.
pub(super) async fn replace_or_create(
    api: &Api<ConfigMap>,
    name: &str,
    cur: Option<ConfigMap>,
    data: BTreeMap<String, String>,
) -> Result<(), kube::Error> {
    let pp = PostParams::default();
    match cur {
        Some(mut cm) => {
            cm.data = Some(data);
            api.replace(name, &pp, &cm).await.map(|_| ())
        }
        None => {
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    ..Default::default()
                },
                data: Some(data),
                ..Default::default()
            };
            api.create(&pp, &cm).await.map(|_| ())
        }
    }
}
